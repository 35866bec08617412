"""SmolLM2 with a chat template that renders tools and tool calls (SmolLM2's own ignores both): the tools as
JSON in the system turn, an assistant's tool calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`,
the form vLLM's `hermes` tool-call parser reads back (it needs no special token in the vocabulary, unlike
`llama3_json`'s `<|python_tag|>`). The weights are SmolLM2's (linked, not copied)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from eagle3_core.artifacts import TargetModel
from eagle3_core.target.prepare import describe_folder

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools, answering with <tool_call>"
    '{"name": ..., "arguments": ...}</tool_call>:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}'
    "<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool_target(smollm2: TargetModel, folder: Path) -> TargetModel:
    """A target folder of SmolLM2's files with TOOLS_TEMPLATE as its chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in Path(smollm2.root).iterdir():
        if source.name in ("chat_template.jinja", "target_model.json"):
            continue
        if source.suffix == ".safetensors":
            os.symlink(source, folder / source.name)
        else:
            shutil.copy(source, folder / source.name)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return describe_folder(folder, "smollm2-tools", "local")
