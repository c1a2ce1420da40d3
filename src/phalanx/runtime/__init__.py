"""Process runtime: joining the process group, device binding, the launcher."""

from phalanx.runtime.context import Context, RuntimeConfig, current_context, init, shutdown

__all__ = ["Context", "RuntimeConfig", "current_context", "init", "shutdown"]
