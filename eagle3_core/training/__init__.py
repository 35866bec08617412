"""Phase 5, draft training (`train_draft`, in `phase`): train-time-test attention (`attention`), the loss
(`loss`), the training loop and its resumable state (`loop`), torchrun process groups (`distributed`) and
the flow's launch of torchrun over `training.processes` processes (`launch`).

Like every phase package, this one imports nothing: callers import the entry point from `phase`, so the
model, attention and loss (torch only) import on the GPU benchmark host, where pydantic is absent."""
