"""Online training (`training.data: online`, `train_online` in `phase`): the target's extraction engine
(`engine`) runs beside training and answers for the states of its next batches; no hidden-state set is
stored. It joins the extraction engine to the training phase, so that neither imports the other."""
