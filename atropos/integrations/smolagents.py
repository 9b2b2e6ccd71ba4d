"""smolagents ``CodeAgent`` code steps run inside a leased slot (``pip install 'atropos-sandbox[smolagents]'``).

``SlotPythonExecutor`` is a smolagents remote Python executor (a ``RemotePythonExecutor``, the
interface its E2B/Docker/Modal executors implement) backed by the slot's ``python_session`` tool:
one persistent interpreter per lease, so variables survive between the agent's steps, and every
step runs in the slot's sandbox (its workspace at ``/workspace``, its uid, no network unless the
lease has it, the host's timeouts and output caps).

    async with pool.leased("trajectory-1") as lease:
        executor = SlotPythonExecutor(lease)                  # built on the pool's event loop
        agent = CodeAgent(tools=[...], model=model, executor=executor)
        answer = await asyncio.to_thread(agent.run, task)     # smolagents is synchronous

What runs where:

* The agent loop and the model calls run in this process.
* The agent's code runs in the slot. Tools are shipped into the slot as source, exactly as
  smolagents does for its other remote executors (``send_tools``), and run there: self-contained
  tools (standard library, or packages present in the sandbox's ``/usr``, or installed with
  ``install_packages`` on a lease with network) are supported. ``final_answer`` is detected the
  way the E2B executor does it: the patched tool raises ``FinalAnswerException`` in the slot and
  its serialised value comes back in the error of the call.
* Tools that must run on the host (they need secrets, host files, or the ToolServer, e.g.
  ``web_search``) cannot be called from the agent's code: the slot has no route to them. Give
  those to a tool-calling agent outside the code steps instead. Managed agents are not supported
  (smolagents refuses them for every remote executor).

A step that times out is interrupted inside the slot and the session keeps its variables; code
that ignores the interrupt gets the session killed and restarted, and the executor then sends the
tools and variables again so later steps still have them (earlier steps' variables are lost).
"""

from __future__ import annotations

import ast
import asyncio
import json
from collections.abc import Sequence
from typing import Any

from smolagents.local_python_executor import CodeOutput
from smolagents.monitoring import AgentLogger, LogLevel
from smolagents.remote_executors import RemotePythonExecutor
from smolagents.tools import Tool, get_tools_definition_code
from smolagents.utils import AgentError

from atropos.errors import ConfigError
from atropos.slots.lease import Lease
from atropos.slots.results import SessionResult

# Runs in the slot's session: which packages are importable already (offline leases can still use
# what the sandbox's /usr ships), and pip (into the user site, importable at once) for the rest
# when the lease has network. The final expression is the report.
_INSTALL = """\
import importlib, importlib.util, site, subprocess, sys
def _atropos_importable(package):
    module = {{"pillow": "PIL", "beautifulsoup4": "bs4", "pyyaml": "yaml", "scikit-learn": "sklearn"}}.get(
        package.lower(), package.split("[")[0].replace("-", "_"))
    return importlib.util.find_spec(module) is not None
_atropos_missing = [p for p in {packages} if not _atropos_importable(p)]
_atropos_log = ""
if _atropos_missing and {network}:
    _atropos_pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--user", "--break-system-packages", "--no-input",
         "--disable-pip-version-check", "-q", *_atropos_missing], capture_output=True, text=True)
    _atropos_log = (_atropos_pip.stdout + _atropos_pip.stderr)[-2000:]
    site.addsitedir(site.getusersitepackages())
    importlib.invalidate_caches()
    _atropos_missing = [p for p in _atropos_missing if not _atropos_importable(p)]
{{"missing": _atropos_missing, "log": _atropos_log}}
"""


def _optional_imports(code: str) -> str:
    """``code`` with each top-level import wrapped in ``try: ... except ImportError: pass``."""
    tree = ast.parse(code)
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom) and not (
                isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            handler = ast.ExceptHandler(type=ast.Name(id="ImportError", ctx=ast.Load()), name=None, body=[ast.Pass()])
            body.append(ast.Try(body=[node], handlers=[handler], orelse=[], finalbody=[]))
        else:
            body.append(node)
    tree.body = body
    return ast.unparse(ast.fix_missing_locations(tree))


class SlotPythonExecutor(RemotePythonExecutor):
    """Runs a smolagents agent's code steps in ``lease``'s persistent Python session.

    ``loop`` is the event loop the lease's pool runs on (default: the running loop at
    construction). smolagents calls executors synchronously, so the agent must run in another
    thread (``await asyncio.to_thread(agent.run, task)``); calling from the loop's own thread would
    deadlock and raises ``ConfigError`` instead. ``timeout_s`` is each step's timeout (the host's
    default when None); ``additional_imports`` are pip packages made available in the slot
    before the first step.
    """

    def __init__(self, lease: Lease, *, loop: asyncio.AbstractEventLoop | None = None,
                 timeout_s: float | None = None, additional_imports: Sequence[str] = (),
                 logger: AgentLogger | None = None, allow_pickle: bool = False) -> None:
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise ConfigError("SlotPythonExecutor needs the event loop the lease's pool runs on: "
                                  "build it inside that loop or pass loop=") from None
        self.lease = lease
        self.loop = loop
        self.timeout_s = timeout_s
        self.steps = 0  # code runs sent to the slot (agent steps, tool definitions, variables)
        self._started = False
        self._setup: list[str] = []  # tool definitions and variables: replayed into a restarted session
        self._recording = False
        self._replay = False
        self._pending_imports = list(additional_imports)
        super().__init__(list(additional_imports), logger or AgentLogger(level=LogLevel.ERROR), allow_pickle)
        self.installed_packages: list[str] = []

    # -- transport -------------------------------------------------------------------------------
    def _session(self, code: str, *, restart: bool = False) -> SessionResult:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise ConfigError("SlotPythonExecutor blocks until the slot answers: run the agent off the event "
                              "loop, e.g. `await asyncio.to_thread(agent.run, task)`")
        future = asyncio.run_coroutine_threadsafe(
            self.lease.python_session(code, restart=restart, timeout_s=self.timeout_s), self.loop)
        self.steps += 1
        return future.result()

    def _prepare(self) -> None:
        """First use: a fresh interpreter (the lease's session may hold someone's state) and the
        requested packages. After a restart: the tools and variables again."""
        if not self._started:
            self._started = True
            self._session("", restart=True)
            if self._pending_imports:
                packages, self._pending_imports = self._pending_imports, []
                self.installed_packages += self._install(packages, strict=True)
        if self._replay:
            self._replay = False
            for code in self._setup:
                self._check(self._session(code))

    # -- smolagents' executor interface ------------------------------------------------------------
    def run_code_raise_errors(self, code: str) -> CodeOutput:
        self._prepare()
        if self._recording:
            self._setup.append(code)
        return self._check(self._session(code))

    def _check(self, r: SessionResult) -> CodeOutput:
        logs = str(r.get("stdout") or "")
        if r.get("stderr"):
            logs += str(r["stderr"])
        if r.get("restarted"):
            self._replay = True  # the next step gets the tools back
        err = r.get("error")
        if err:
            if err.get("type") == self.FINAL_ANSWER_EXCEPTION:
                value = self._deserialize_final_answer(str(err.get("message", "")), self.allow_pickle)
                return CodeOutput(output=value, logs=logs, is_final_answer=True)
            detail = err.get("traceback") or f"{err.get('type')}: {err.get('message')}"
            raise AgentError(f"{logs}\nExecuting code yielded an error:\n{detail}", self.logger)
        return CodeOutput(output=r.get("value"), logs=logs, is_final_answer=False)

    def send_tools(self, tools: dict[str, Tool]) -> None:
        """As smolagents' remote executors do (final_answer patched to raise, requirements
        installed, tools defined from their source), except that the imports smolagents hoists to
        the top of the definitions are optional: they include the patched final_answer's guarded
        numpy/PIL imports, and every tool method imports what it needs again itself."""
        if "final_answer" in tools:
            self._patch_final_answer_with_exception(tools["final_answer"])
        packages = {pkg for t in tools.values() for pkg in t.to_dict()["requirements"]
                    if pkg not in [*self.installed_packages, "smolagents"]}
        if "PIL" in packages:
            packages.discard("PIL")
            packages.add("pillow")
        if packages:
            self.installed_packages += self.install_packages(sorted(packages))
        code = get_tools_definition_code(tools)
        if code:
            self._recording = True
            try:
                self.logger.log(self.run_code_raise_errors(_optional_imports(code)).logs)
            finally:
                self._recording = False

    def send_variables(self, variables: dict[str, Any]) -> None:
        self._recording = True
        try:
            super().send_variables(variables)
        finally:
            self._recording = False

    def install_packages(self, additional_imports: list[str]) -> list[str]:
        # Called by send_tools with the tools' detected imports, which include optional ones
        # (smolagents' patched final_answer mentions numpy and PIL inside try/except): a package
        # that cannot be had is a warning here; the code that needs it fails with ImportError.
        return self._install(additional_imports, strict=False)

    def _install(self, packages: list[str], *, strict: bool) -> list[str]:
        """Make ``packages`` importable in the slot; returns those that are. With ``strict``, a
        package that is missing afterwards raises AgentError."""
        if not packages:
            return []
        self._prepare()
        wanted = sorted(set(packages))
        code = _INSTALL.format(packages=json.dumps(wanted), network=bool(self.lease.network))
        report = ast.literal_eval(str(self._check(self._session(code)).output))
        missing = list(report["missing"])
        if missing:
            why = report["log"] or "the lease has no network to download them (lease with network=True)"
            message = f"packages not available in the slot: {', '.join(missing)}: {why}"
            if strict:
                raise AgentError(message, self.logger)
            self.logger.log(message, level=LogLevel.INFO)
        return [p for p in wanted if p not in missing]

    def cleanup(self) -> None:
        """Nothing to tear down: the lease's owner releases it, and the release ends the session."""
