"""The ``alerts`` resource: where alerts go.

Every alert is always written to Dagster: the caller's log (a run's event log, or a
sensor tick's log) and, when it concerns an asset, an ``AssetObservation`` in the
instance's event log (visible on the asset's page). If a webhook URL is configured, it
also receives a Slack-compatible JSON message ``{"text": ...}``. Alert text and metadata
never contain credentials: every URI in them is redacted before anything is sent.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import dagster as dg
from pydantic import Field

from resources.env import describe_url, expand_env, redact_text

Severity = Literal["warning", "error"]
MetadataScalar = int | float | str | bool

_ICONS = {"warning": ":warning:", "error": ":rotating_light:"}


@dataclass(frozen=True)
class Alert:
    """One alert.

    Attributes:
        kind: a stable identifier (``inline_over_limit``, ``compaction_backlog``,
            ``inline_fallthrough``, ``compaction_run_failed``).
        title: one line.
        details: more lines of text.
        severity: ``warning`` or ``error``.
        asset_keys: the assets it concerns (an observation is recorded on each).
        metadata: numbers and short strings, recorded with the observation.
    """

    kind: str
    title: str
    details: str = ""
    severity: Severity = "warning"
    asset_keys: tuple[dg.AssetKey, ...] = ()
    metadata: Mapping[str, MetadataScalar] = field(default_factory=dict)

    def text(self) -> str:
        """The message text (redacted)."""
        body = f"{_ICONS[self.severity]} *persist-pipeline* {self.title}"
        if self.details:
            body += f"\n{self.details}"
        return redact_text(body)

    def safe_metadata(self) -> dict[str, MetadataScalar]:
        """``metadata`` with every string value redacted."""
        return {k: redact_text(v) if isinstance(v, str) else v for k, v in self.metadata.items()}


class _HasLogAndInstance(Protocol):
    @property
    def log(self) -> Any: ...

    @property
    def instance(self) -> dg.DagsterInstance: ...


class AlertsResource(dg.ConfigurableResource):
    """Alert delivery: the Dagster event log always, plus an optional webhook."""

    webhook_url: str = Field(
        default="",
        description="Slack-compatible incoming webhook (http/https) that receives "
                    '{"text": ...}; empty for none. ${VAR} templates are expanded when an '
                    "alert is sent, so the URL (a secret) never shows in the UI.")
    timeout_s: float = Field(default=5.0, gt=0, description="Webhook request timeout.")

    def resolved_webhook_url(self) -> str:
        return expand_env(self.webhook_url, what="alerts.webhook_url").strip()

    def send(self, alert: Alert, context: _HasLogAndInstance | None = None) -> bool:
        """Deliver ``alert``; returns whether the webhook accepted it (False if none).

        Never raises for a delivery problem: a broken webhook is logged as an error.
        """
        text = alert.text()
        logger = context.log if context is not None else logging.getLogger(__name__)
        (logger.error if alert.severity == "error" else logger.warning)(
            f"[alert {alert.kind}] {text}")
        if context is not None and alert.asset_keys:
            metadata: dict[str, Any] = {"alert": alert.kind, "severity": alert.severity,
                                        "message": text, **alert.safe_metadata()}
            for key in alert.asset_keys:
                context.instance.report_runless_asset_event(
                    dg.AssetObservation(asset_key=key, metadata=metadata))
        return self._post(text, logger)

    def _post(self, text: str, logger: Any) -> bool:
        url = self.resolved_webhook_url()
        if not url:
            return False
        shown = describe_url(url)
        if not url.lower().startswith(("http://", "https://")):
            logger.error(f"alert webhook {shown} is not an http(s) URL; alert not sent")
            return False
        request = urllib.request.Request(  # noqa: S310 - scheme checked above
            url, data=json.dumps({"text": text}).encode(), method="POST",
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310
                response.read()
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or getattr(e, "code", None) or type(e).__name__
            logger.error(f"alert webhook {shown} failed: {redact_text(str(reason))}")
            return False
        return True
