"""Chat templates: the tokenizer's own, or a named one for a tokenizer without a template, and its end-of-turn tokens.

A template is the Jinja text ``tokenizer.apply_chat_template`` renders (Hugging Face's format: ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``). :func:`resolve_template` picks it:

- ``auto``: the tokenizer's own ``chat_template`` (what the model was released with; the inference stack formats
  prompts with it), else a refusal naming ``data.template``;
- a name of :data:`NAMED`: ``chatml`` (Qwen's ``<|im_start|>``/``<|im_end|>`` markers), ``llama3``
  (``<|start_header_id|>``/``<|eot_id|>``), ``alpaca`` (``### Instruction:``/``### Response:`` in plain text, each
  response ended by the tokenizer's end-of-sequence token: any tokenizer takes it) or ``none`` (the texts joined, the
  end-of-sequence token after each response: TRL's non-conversational prompt-completion);
- a path to a ``.jinja`` file.

A named template whose markers are not single tokens of the vocabulary is refused (the model would have to learn to
spell its own turn markers). The chosen template is set on the tokenizer, so the exported model folder carries it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

NAMED: dict[str, str] = {
    "chatml": ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{%- endif %}"),
    "llama3": ("{{ bos_token }}{%- for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{%- endfor %}{%- if "
               "add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"),
    "alpaca": ("{%- for message in messages %}{%- if not loop.first %}{{ '\n\n' }}{%- endif %}{%- if message['role'] "
               "== 'system' %}{{ message['content'] }}{%- elif message['role'] == 'user' %}{{ '### Instruction:\n' + "
               "message['content'] }}{%- else %}{{ '### Response:\n' + message['content'] + eos_token }}{%- endif %}"
               "{%- endfor %}{%- if add_generation_prompt %}{{ '\n\n### Response:\n' if messages else "
               "'### Response:\n' }}{%- endif %}"),
    "none": ("{%- for message in messages %}{{ message['content'] }}{%- if message['role'] == 'assistant' %}"
             "{{ eos_token }}{%- endif %}{%- endfor %}"),
}
#: the marker strings a named template needs as single tokens
MARKERS = {"chatml": ("<|im_start|>", "<|im_end|>"), "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")}


class Template(NamedTuple):
    """The template text, where it came from (the start-up table's words) and its name (``""``: the tokenizer's)."""

    text: str
    source: str
    name: str = ""


def _own_template(tokenizer: Any) -> str | None:
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    return own if isinstance(own, str) and own.strip() else None


def resolve_template(tokenizer: Any, template: str | None = "auto", owner: str = "SFTDataModule") -> Template:
    """The template to render conversations with (see the module docstring).

    Raises:
        ValueError: ``auto`` on a tokenizer without a template; an unknown name or a missing file; a named template
            whose markers the vocabulary does not hold as single tokens.
    """
    template = "auto" if template in (None, "") else str(template)
    if template == "auto":
        own = _own_template(tokenizer)
        if own is None:
            raise ValueError(f"{owner}(template=auto): the tokenizer ({getattr(tokenizer, 'name_or_path', '')}) has no "
                             "chat template. Fix: data.template=<one of "
                             f"{', '.join(NAMED)}> (alpaca fits any tokenizer), or data.template=<a .jinja file>")
        return Template(own, "the tokenizer's own")
    if template in NAMED:
        check_markers(tokenizer, template, owner)
        return Template(NAMED[template], f"data.template={template} (the tokenizer has "
                                         f"{'one of its own' if _own_template(tokenizer) else 'none'})", template)
    path = Path(template).expanduser()
    if path.suffix in (".jinja", ".j2", ".txt") and path.is_file():
        return Template(path.read_text(), f"data.template={path}")
    raise ValueError(f"{owner}(template={template!r}): not auto, a named template ({', '.join(NAMED)}) or a .jinja "
                     "file. Fix: data.template=auto (the tokenizer's own), data.template=alpaca, or a path to a "
                     ".jinja file")


def check_markers(tokenizer: Any, name: str, owner: str = "SFTDataModule") -> None:
    """Refuse ``name`` when one of its markers is not a single token of ``tokenizer``'s vocabulary.

    Raises:
        ValueError: Naming the marker, how many pieces it would be, and the template that fits any tokenizer.
    """
    for marker in MARKERS.get(name, ()):
        pieces = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(pieces) != 1:
            raise ValueError(f"{owner}(template={name}): the tokenizer has no {marker} token (the marker would be "
                             f"{len(pieces)} pieces, and the model would have to learn to spell its turn markers). "
                             "Fix: data.template=alpaca (each response ends with the tokenizer's end-of-sequence "
                             "token), or a tokenizer that has the chat tokens")


def turn_end_ids(tokenizer: Any, template: Template) -> list[int]:
    """Token ids that end an assistant turn: the end-of-sequence token and the first special token the template
    writes after a response (``<|im_end|>``, ``<|eot_id|>``), for stopping a generation."""
    ids = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    try:
        text = tokenizer.apply_chat_template(probe, chat_template=template.text, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe: rendering the data will say why
        return ids
    after = text[text.rfind("y") + 1:]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    for token in tokenizer(after, add_special_tokens=False)["input_ids"][:1]:
        if token in special and token not in ids:
            ids.append(token)
    return ids
