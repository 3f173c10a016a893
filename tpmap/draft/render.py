"""Step 7 of a draft: the YAML text, with its TODO comments."""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field

from tpmap.draft.entries import Entry
from tpmap.language.errors import MappingErrors
from tpmap.language.source import load_text
from tpmap.tool_errors import DraftError

WIDTH = 110
YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "y", "n"}  # plain, YAML reads them as non-strings


def scalar(value) -> str:
    """YAML for a value of a draft (flow style), read back by YAML as the same value and type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}[repr(value)]
        mantissa, e, exponent = repr(value).partition("e")
        return (mantissa if "." in mantissa else mantissa + ".0") + (f"e{int(exponent):+03d}" if e else "")
    if isinstance(value, list):
        return "[" + ", ".join(scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {scalar(v)}" for k, v in value.items()) + "}"
    text = str(value)
    plain = re.fullmatch(r"[A-Za-z_][\w.*/ ()+-]*(?<! )", text) and text.lower() not in YAML_WORDS
    return text if plain else '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def comment(notes: list[str], indent: str) -> list[str]:
    return [line for note in notes for line in textwrap.wrap(
        note, WIDTH, initial_indent=indent + "# ", subsequent_indent=indent + "#   ", break_on_hyphens=False)]


def flow(items: dict, indent: int) -> str:
    """A flow mapping wrapped at WIDTH, continuation lines under its first key."""
    parts = [f"{k}: {scalar(v)}" for k, v in items.items()]
    if not parts:
        return "{}"
    lines, line = [], "{"
    for k, part in enumerate(parts):
        part += "," if k < len(parts) - 1 else "}"
        if indent + len(line) + len(part) > WIDTH and line.strip() != "{":
            lines.append(line.rstrip())
            line = " " * (indent + 1)
        line += part + " "
    return "\n".join(lines + [line.rstrip()])


def render_entry(entry: Entry) -> list[str]:
    lines = comment(entry.notes, "  ") + [f"  - kind: {entry.kind}", f"    module: {scalar(entry.module)}"]
    for key, value in entry.fields.items():
        if key == "attributes":
            lines += ["    attributes:"] + [f"      {path}: {scalar(e)}" for path, e in value.items()]
        elif key == "sections" and isinstance(value, list):
            lines += ["    sections:"] + [f"      - {k}: {scalar(v)}" for section in value for k, v in section.items()]
        else:
            lines.append(f"    {key}: {scalar(value)}")
    return lines


@dataclass(kw_only=True)
class Draft:
    model_type: str
    model_class: str
    config: dict
    entries: list[Entry]
    whole: list[Entry]
    grad_allreduce: list[str]
    vocab_parallel: dict | None
    header: list[str]
    notes: list[str]
    default_config: dict = field(default_factory=dict)  # from a shipped mapping: what the default lacks
    world_sizes: list[int] = field(default_factory=lambda: [1])
    verify_world_sizes: list[int] = field(default_factory=lambda: [1])

    def render(self) -> str:
        lines = ["# yaml-language-server: $schema=mapping.schema.json"] + comment(self.header + self.notes, "")
        lines += [f"model_type: {self.model_type}",
                  f"world_sizes: {scalar(self.world_sizes)}   # where the planner accepts this draft (default config)"]
        if self.default_config:
            lines.append(f"default_config: {scalar(self.default_config)}   # from the shipped mapping")
        lines.append("entries:")
        for entry in self.entries:
            lines += render_entry(entry)
        if self.whole:
            lines.append("replicated:   # kept whole on every rank")
            for entry in self.whole:
                lines += comment(entry.notes, "  ") + [f"  - {scalar(entry.module)}"]
        if self.grad_allreduce:
            lines.append(f"grad_allreduce: {scalar(self.grad_allreduce)}   # base_model_tp_plan: "
                         "replicated_with_grad_allreduce")
        if self.vocab_parallel:
            lines.append(f"vocab_parallel: {scalar(self.vocab_parallel)}")
        if any(isinstance(v, dict) for v in self.config.values()):  # nested configs: one key a line
            config = ["    config:"] + [f"      {k}: {flow(v, 8 + len(k)) if isinstance(v, dict) else scalar(v)}"
                                         for k, v in self.config.items()]
        else:
            config = [f"    config: {flow(self.config, 12)}"]
        lines += ["verify:", "  - name: tiny", *config,
                  f"    models: [{self.model_class}]", f"    world_sizes: {scalar(self.verify_world_sizes)}"]
        return "\n".join(lines) + "\n"

    def load(self):
        """The draft loaded as a mapping; a schema failure is a drafter bug, reported with the text."""
        text = self.render()
        try:
            return load_text(text, f"<draft of {self.model_type}>")
        except MappingErrors as e:
            raise DraftError(f"the draft of {self.model_type!r} fails the schema (a tpmap bug):\n{e}\n{text}") from None
