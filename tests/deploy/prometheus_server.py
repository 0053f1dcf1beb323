"""A real Prometheus server (Debian's `prometheus` binary) for the cluster tests.

It runs deploy/prometheus/prometheus.yml as shipped, with only what a test must change:
a 1 s scrape/evaluation interval, the router's real address, and the alert rules file by
absolute path. Worker targets come from the router's /metrics/targets (HTTP service
discovery), as shipped.
"""
from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deploy_checks as dc
import httpx
import yaml

PROMETHEUS = shutil.which("prometheus")
SHIPPED_CONFIG = dc.DEPLOY / "prometheus" / "prometheus.yml"


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    """Poll cond() until it returns something truthy; a timeout names what was awaited."""
    end = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < end:
        try:
            value = cond()
            if value:
                return value
        except (httpx.HTTPError, ValueError, KeyError) as e:  # not up yet, or a bad answer
            last_error = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}"
                         + (f" (last error: {last_error!r})" if last_error else ""))


def write_config(folder: Path, router_address: str) -> Path:
    """The shipped config, adapted for a test; returns the config file's path."""
    cfg = yaml.safe_load(SHIPPED_CONFIG.read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = "1s"
    cfg["rule_files"] = [str(SHIPPED_CONFIG.parent / f) for f in cfg["rule_files"]]
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    jobs["pdserve-router"]["static_configs"] = [{"targets": [router_address]}]
    for sd in jobs["pdserve-workers"]["http_sd_configs"]:
        sd["url"] = f"http://{router_address}/metrics/targets"
        sd["refresh_interval"] = "1s"
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class PrometheusServer:
    """`prometheus` on 127.0.0.1:port with its TSDB under `folder`; stop() kills it."""

    def __init__(self, config: Path, folder: Path, port: int, startup_timeout: float = 60) -> None:
        if PROMETHEUS is None:
            raise FileNotFoundError("prometheus binary not on PATH (Debian package `prometheus`)")
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = folder / "prometheus.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(self._ready, startup_timeout, "prometheus /-/ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n"
                                 + self.log_path.read_text(errors="replace"))
        return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200

    def api(self, path: str, **params: str) -> Any:
        """The `data` of a Prometheus HTTP API answer; an error answer raises with its text."""
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"GET /api/v1/{path} {params}: {r.status_code} {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant vector result of a PromQL query (a list of {metric, value})."""
        data = self.api("query", query=expr)
        if data["resultType"] != "vector":
            raise AssertionError(f"{expr!r}: expected a vector, got {data['resultType']}")
        return data["result"]

    def finite_values(self, expr: str) -> list[float]:
        """The query's sample values that are numbers (histogram_quantile of no rate is NaN)."""
        values = [float(s["value"][1]) for s in self.query(expr)]
        return [v for v in values if math.isfinite(v)]

    def targets_up(self) -> dict[str, str]:
        """scrape URL -> health of every active target."""
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def stop(self, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
