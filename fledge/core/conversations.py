"""fledge's conversation record, the file format between `prep`, `regen` and `tokenize`: one
JSON object a line (`.jsonl`, or `.jsonl.gz`), {"id", "source"?, "messages": [{"role": "system" |
"user" | "assistant", "content": text}]}."""

from __future__ import annotations

from pathlib import Path

from fledge.core.errors import FledgeError
from fledge.core.files import read_jsonl

ROLES = ("system", "user", "assistant")


def read_conversations(path: Path) -> list[dict]:
    """Every record of `path`, each checked; the usual mix-ups (a raw ShareGPT file, a tokenized
    file) are named."""
    rows = []
    try:
        for lineno, r in read_jsonl(path):
            where = f"{path}:{lineno}"
            if not isinstance(r, dict):
                raise FledgeError(f"{where}: a JSON {type(r).__name__}, not a conversation record")
            if "input_ids" in r:
                raise FledgeError(f"{where}: a tokenized sample, not a conversation (train.jsonl, not "
                                  f"train.tok.jsonl)")
            if "messages" not in r:
                hint = "; run `fledge prep` on it first" if "conversations" in r or "instruction" in r else ""
                raise FledgeError(f"{where}: no 'messages' (keys {sorted(r)[:6]}){hint}")
            if "id" not in r:
                raise FledgeError(f"{where}: no 'id'; outputs are keyed by it (`fledge prep` adds them)")
            msgs = r["messages"]
            if not (isinstance(msgs, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                   and m.get("role") in ROLES for m in msgs)):
                raise FledgeError(f"{where}: 'messages' must be a list of {{role: {'|'.join(ROLES)}, "
                                  f"content: text}}")
            rows.append(r)
    except UnicodeDecodeError as e:
        raise FledgeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a line)") from None
    except RecursionError:
        raise FledgeError(f"{path}: JSON nested too deeply to read") from None
    except (OSError, EOFError) as e:  # a cut-off or corrupt .gz
        raise FledgeError(f"{path}: cannot read ({e})") from None
    return rows
