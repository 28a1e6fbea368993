"""``sandbox`` and ``process_annotator``: one agentic episode's isolation and limits (V4.1 report
§5.1.3, in miniature) and the process weights of its segments (walkthrough Ch. 7, Eq. 30).

Every episode's tools run in their own sandbox (:mod:`megatron_s2.posttrain.agentic.sandbox`):
a private copy of the task workspace on a size-limited tmpfs, no network, and per-command
limits on CPU, memory, wall time, processes and file size. The numbers below are those limits;
``backend`` picks the isolation tool. Torch-free (a recipe loads it without importing torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_s2.config.schema import ConfigError

__all__ = ["SandboxConfig", "ProcessAnnotatorConfig", "AGENT_HARNESSES", "check_agent"]

AGENT_HARNESSES = ("builtin", "openai_agents", "anthropic", "smolagents")
"""The harness adapters of ``megatron_s2/posttrain/agentic/harnesses.py`` (``HARNESSES``), by name."""


def check_agent(agent: dict, what: str) -> None:
    """An agentic environment's ``agent`` mapping: ``harness`` (one of :data:`AGENT_HARNESSES`), for
    openai_agents ``api``, for anthropic ``declare_tools`` (default true: the tools go in the request's
    ``tools`` as JSON schemas, which the chat template renders into the prompt; false: the request
    declares none and the tools are named only in the system message, as the builtin harness does —
    about 850 fewer prompt tokens with the tiny tokenizer: 635 instead of 1,489); nothing else."""
    if not isinstance(agent, dict):
        raise ConfigError(f"{what}: expected a mapping like {{harness: builtin}}, got {type(agent).__name__}")
    unknown = sorted(set(agent) - {"harness", "api", "declare_tools"})
    if unknown:
        raise ConfigError(f"{what}.{unknown[0]}: not a setting of an agentic environment's agent (known: harness, "
                          "api, declare_tools); the turn budget is environment.max_turns, tokens per call rollout.max_new_tokens")
    harness = agent.get("harness", "builtin")
    if harness not in AGENT_HARNESSES:
        raise ConfigError(f"{what}.harness: unknown harness {harness!r}; known: {', '.join(AGENT_HARNESSES)}")
    api = agent.get("api", "chat")
    if api not in ("chat", "responses") or ("api" in agent and harness != "openai_agents"):
        raise ConfigError(f"{what}.api: {api!r} — api chooses the OpenAI Agents SDK's protocol (chat | responses) "
                          "and needs harness: openai_agents")
    if "declare_tools" in agent and type(agent["declare_tools"]) is not bool:
        raise ConfigError(f"{what}.declare_tools: {agent['declare_tools']!r} — expected true or false")
    if "declare_tools" in agent and harness != "anthropic":
        raise ConfigError(f"{what}.declare_tools: only with harness: anthropic (got harness: {harness}; the builtin "
                          "harness never declares schemas, the other harnesses need theirs) — remove the key")


@dataclass(frozen=True)
class SandboxConfig:
    """Isolation backend and resource limits of one episode's sandbox."""

    backend: Literal["auto", "bwrap", "unshare"] = "auto"
    """'bwrap': bubblewrap (read-only system, private tmpfs workspace, all namespaces unshared);
    'unshare': Linux namespaces via util-linux ``unshare`` + rlimits (no bwrap needed);
    'auto': bwrap when it works here, else unshare (a one-line error when neither does)."""
    uid: int = 61000
    """First unprivileged host uid the sandboxed processes run as when the runner is root (root
    ignores the process limit and file permissions)."""
    uid_pool: int = 64
    """Uids ``uid .. uid + uid_pool - 1``: every open sandbox takes one of its own (the process
    limit counts processes per host uid), so sandboxes open at once are at most this many."""
    command_timeout_s: float = 10.0
    """Wall-clock limit of one tool command; past it the command's whole process tree is killed."""
    cpu_seconds: int = 10
    """RLIMIT_CPU of each command (CPU seconds)."""
    memory_mb: int = 1024
    """Memory of a command (MiB): RLIMIT_AS of each of its processes, and the resident memory of
    all the sandbox's processes together (the server kills the command past it)."""
    max_processes: int = 64
    """RLIMIT_NPROC: processes of the sandbox uid (stops fork bombs)."""
    max_file_mb: int = 16
    """RLIMIT_FSIZE: largest file a command may write (MiB)."""
    workspace_mb: int = 64
    """Size of the tmpfs holding the workspace (a full disk costs only this episode)."""
    output_chars: int = 8000
    """Characters of a command's stdout/stderr kept in the observation (the rest is cut)."""

    def __post_init__(self):
        if self.backend not in ("auto", "bwrap", "unshare"):
            raise ConfigError(f"sandbox.backend: {self.backend!r} is not one of ['auto', 'bwrap', 'unshare']")
        if not 1 <= self.uid < 2**31 - 1:
            raise ConfigError(f"sandbox.uid: must be a positive uid other than root, got {self.uid}")
        if self.command_timeout_s <= 0:
            raise ConfigError(f"sandbox.command_timeout_s: must be > 0, got {self.command_timeout_s}")
        for name in ("uid_pool", "cpu_seconds", "memory_mb", "max_processes", "max_file_mb", "workspace_mb",
                     "output_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"sandbox.{name}: must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ProcessAnnotatorConfig:
    """Process weights w in [-1, 1] per assistant segment (walkthrough Ch. 7, Eq. 30). The
    categories are the paper's; the default values are the walkthrough's (illustrative) ones."""

    malformed: float = 0.0
    """A segment whose tool call does not parse (or that has none): earns nothing."""
    invalid_tool: float = 0.0
    """A call to a tool that is not in the registry: earns nothing."""
    repeated_failed_call: float = -0.5
    """The same call (name and arguments) as an earlier call of the session that failed: pushed down."""
    limit_stop: float = -0.5
    """The last segment of a session cut by the turn, context or session-time limit: pushed down."""
    clean: float = 1.0
    """Everything else: full credit."""

    def __post_init__(self):
        for name in ("malformed", "invalid_tool", "repeated_failed_call", "limit_stop", "clean"):
            value = getattr(self, name)
            if not -1.0 <= value <= 1.0:  # also rejects NaN
                raise ConfigError(f"process_annotator.{name}: a process weight must lie in [-1, 1] "
                                  f"(it may invert credit, never amplify it), got {value}")
