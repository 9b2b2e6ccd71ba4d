"""Test an AgentEnv in seconds, without a model.

* :func:`scripted_server` / :class:`ScriptedServer`: an in-process inference server (an atroposlib
  ``APIServer``) answered by your code; set it as the env's ``server_cls``.
* :class:`FakeChatServer`: an OpenAI-compatible HTTP server on 127.0.0.1 answered by a policy
  function; point ``--openai.base_url`` at it to run ``process``/``serve``/``evaluate`` for real.
* :func:`run_group` / :func:`make_env`: an env whose model is a scripted policy, on a real local pool.
* :func:`by_turn`, :func:`tool_call`, :func:`answer`: write a policy as the list of its turns.

See docs/write-an-environment.md.
"""

from typing import TYPE_CHECKING, Any

from atropos.testing.envs import make_env, run_group
from atropos.testing.scripted import (
    Policy,
    ScriptedServer,
    ScriptedTokenServer,
    answer,
    by_turn,
    call,
    call_text,
    logprob_of,
    reply,
    scripted_server,
    server_configs,
    token_server_configs,
    tool_call,
)

if TYPE_CHECKING:
    from atropos.testing.fake_server import ChatPolicy, FakeChatServer


def __getattr__(name: str) -> Any:
    # imported on first use: importing it here made `python -m atropos.testing.fake_server` warn
    # (a RuntimeWarning: the module was in sys.modules before runpy executed it)
    if name in ("ChatPolicy", "FakeChatServer"):
        from atropos.testing import fake_server

        return getattr(fake_server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["ChatPolicy", "FakeChatServer", "Policy", "ScriptedServer", "ScriptedTokenServer", "answer", "by_turn",
           "call", "call_text", "logprob_of", "make_env", "reply", "run_group", "scripted_server", "server_configs",
           "token_server_configs", "tool_call"]
