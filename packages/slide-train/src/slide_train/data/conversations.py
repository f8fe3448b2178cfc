"""Chat and ShareGPT rows as the messages a chat template renders, every role one the template takes.

A role the template does not know is refused, naming the row: templates that render any role verbatim would
otherwise turn a misspelt `usr` into context the model never learns to answer, silently.
"""

from __future__ import annotations

from .config import ROLES, DataError
from .sources import get_key

# The role names of ShareGPT datasets. `function_call` is the model's own turn (a call it learns to make) and
# `observation` the tool's answer, as in the datasets that use them.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}


class RoleMap:
    """The role names of a dataset's rows mapped onto roles: data.roles first, then the format's own names."""

    def __init__(self, roles: dict[str, str], defaults: dict[str, str] | None = None):
        self.names = {**{r: r for r in ROLES}, **(defaults or {}), **roles}
        self.known = [*ROLES, *sorted({r for r in roles.values() if r not in ROLES})]
        self.aliases = sorted(n for n in self.names if n not in self.known)

    def __call__(self, name: str, where: str) -> str:
        if name not in self.names:
            also = f" (and the names {', '.join(self.aliases)} for them)" if self.aliases else ""
            raise DataError(
                f"{where}: unknown role {name!r}; known roles: {', '.join(self.known)}{also}; map other names "
                f"onto them with data.roles (e.g. --data.roles.{name}=user)"
            )
        return self.names[name]


def chat_messages(row: dict, where: str, roles: RoleMap) -> list[dict]:
    """`messages: [{role, content}, ...]`, roles mapped; other keys of a message (name, tool_calls) are kept."""
    messages = get_key(row, "messages", where, list)
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: messages[{j}] must be an object with 'role' and 'content'")
        role = get_key(m, "role", f"{where} messages[{j}]")
        get_key(m, "content", f"{where} messages[{j}]")
        out.append({**m, "role": roles(role, f"{where} messages[{j}]")})
    return out


def sharegpt_messages(row: dict, where: str, roles: RoleMap) -> list[dict]:
    """`conversations: [{from, value}, ...]` (and an optional `system` prompt) as chat messages; other keys of a
    turn (name) are kept, as for chat rows."""
    turns = get_key(row, "conversations", where, list)
    system = get_key(row, "system", where, str, required=False)
    out = [{"role": "system", "content": system}] if system else []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: conversations[{j}] must be an object with 'from' and 'value'")
        name = get_key(turn, "from", f"{where} conversations[{j}]")
        value = get_key(turn, "value", f"{where} conversations[{j}]")
        rest = {k: v for k, v in turn.items() if k not in ("from", "value")}
        out.append({**rest, "role": roles(name, f"{where} conversations[{j}]"), "content": value})
    return out
