"""What the dashboard was started with: the environment ``kvtrace dashboard`` sets for the Streamlit
process (:meth:`Settings.environ`), read back on each page run (:meth:`Settings.from_env`)."""

from __future__ import annotations

import dataclasses
import os

ENV_DB = "KVTRACE_DB"
ENV_COLLECTOR = "KVTRACE_COLLECTOR"
ENV_TOKEN = "KVTRACE_TOKEN"
ENV_APM_URL = "KVTRACE_APM_URL"
ENV_REFRESH_S = "KVTRACE_REFRESH_S"


@dataclasses.dataclass(frozen=True)
class Settings:
    db: str | None = None
    collector: str | None = None
    token: str | None = None
    apm_url: str | None = None
    """An "open in your APM" link for a trace; ``{trace_id}`` is replaced."""
    refresh_s: float = 5.0

    @classmethod
    def from_env(cls) -> "Settings":
        refresh = os.environ.get(ENV_REFRESH_S)
        return cls(db=os.environ.get(ENV_DB) or None, collector=os.environ.get(ENV_COLLECTOR) or None,
                   token=os.environ.get(ENV_TOKEN) or None, apm_url=os.environ.get(ENV_APM_URL) or None,
                   refresh_s=float(refresh) if refresh else 5.0)

    def environ(self) -> dict[str, str]:
        """These settings as the environment that carries them to the Streamlit process."""
        values = {ENV_DB: self.db, ENV_COLLECTOR: self.collector, ENV_TOKEN: self.token,
                  ENV_APM_URL: self.apm_url, ENV_REFRESH_S: str(self.refresh_s)}
        return {key: value for key, value in values.items() if value}
