"""Checks rendered Kubernetes manifests of walbox's chart (run by deploy/check).

Usage: check.py WALBOX_BIN PROMTOOL FILE...

Every object passes kubernetes-validate's strict schemas (Kubernetes 1.28 and
the newest the package carries); prometheus-operator objects, which it has no
schema for, are checked by promtool (the rules) and by shape. Then what walbox
relies on: numeric non-root user, read-only root filesystem, no
capabilities, a grace period above walbox's shutdown bound, the probes, a
rollout that can finish with a standby, the disruption budget, and a
walbox.toml that `walbox config` accepts.
"""

import os
import subprocess
import sys
import tempfile

import kubernetes_validate
import yaml

VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]
OPERATOR = "monitoring.coreos.com/v1"
failures = []


def fail(where, what):
    failures.append(f"{where}: {what}")


def check_deployment(where, d, walbox, docs):
    spec = d["spec"]
    pod = spec["template"]["spec"]
    psc = pod.get("securityContext", {})
    if not isinstance(psc.get("runAsUser"), int) or psc["runAsUser"] == 0:
        fail(where, f"runAsUser must be a numeric non-root UID, is {psc.get('runAsUser')!r}")
    if psc.get("runAsNonRoot") is not True:
        fail(where, "runAsNonRoot must be true")
    if pod.get("automountServiceAccountToken") is not False:
        fail(where, "the service account token must not be mounted")
    [c] = pod["containers"]
    sc = c.get("securityContext", {})
    if sc.get("readOnlyRootFilesystem") is not True:
        fail(where, "readOnlyRootFilesystem must be true")
    if sc.get("allowPrivilegeEscalation") is not False:
        fail(where, "allowPrivilegeEscalation must be false")
    if sc.get("capabilities", {}).get("drop") != ["ALL"]:
        fail(where, "capabilities must drop ALL")
    if c["livenessProbe"]["httpGet"]["path"] != "/healthz":
        fail(where, "liveness must probe /healthz")
    if c["readinessProbe"]["httpGet"]["path"] != "/readyz?standby=ready":
        fail(where, "readiness must probe /readyz?standby=ready (a waiting standby is ready)")
    # A rollout must not wait for a pod that cannot become ready: with the
    # standby ready, surge 1 / unavailable 0 finishes; anything else must be
    # Recreate.
    strategy = spec.get("strategy", {})
    if strategy.get("type") == "RollingUpdate":
        if strategy["rollingUpdate"].get("maxUnavailable") != 0:
            fail(where, "the rolling update must keep the active pod until a standby is ready")
    # walbox exits within shutdown_timeout_secs + 6 s of SIGTERM.
    toml_text = next(
        doc["data"]["walbox.toml"] for doc in docs if doc and doc["kind"] == "ConfigMap"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(toml_text)
        path = f.name
    env = dict(os.environ, WALBOX_PG_URL="host=db user=walbox dbname=app")
    for e in c.get("env", []):
        # Mounted Secret files are not here: the Secret's values are not checked.
        if "value" in e and not e["name"].endswith("_FILE"):
            env[e["name"]] = e["value"]
    out = subprocess.run(
        [walbox, "config", "--config", path], env=env, capture_output=True, text=True
    )
    os.unlink(path)
    if out.returncode != 0:
        fail(where, f"walbox refuses the rendered walbox.toml: {out.stderr.strip()}")
        return
    shutdown = next(
        int(line.split("=")[1].split()[0])
        for line in out.stdout.splitlines()
        if line.startswith("shutdown_timeout_secs")
    )
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if grace <= shutdown + 6:
        fail(where, f"terminationGracePeriodSeconds {grace} is not above walbox's bound {shutdown} + 6 s")


def main():
    walbox, promtool, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    for name in files:
        with open(name) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        kinds = [d["kind"] for d in docs]
        for want in ["Deployment", "Service", "ConfigMap", "PodDisruptionBudget"]:
            if want not in kinds:
                fail(name, f"no {want}")
        for d in docs:
            where = f"{name}: {d['kind']}/{d['metadata']['name']}"
            if d["apiVersion"] == OPERATOR:
                if d["kind"] == "PrometheusRule":
                    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
                        yaml.safe_dump(d["spec"], f)
                        rules = f.name
                    out = subprocess.run(
                        [promtool, "check", "rules", rules], capture_output=True, text=True
                    )
                    os.unlink(rules)
                    if out.returncode != 0:
                        fail(where, out.stdout + out.stderr)
                elif d["kind"] == "ServiceMonitor":
                    ports = [e.get("port") for e in d["spec"]["endpoints"]]
                    if ports != ["metrics"]:
                        fail(where, f"endpoints scrape {ports}, not the metrics port")
                else:
                    fail(where, "unexpected kind")
                continue
            for version in VERSIONS:
                try:
                    kubernetes_validate.validate(d, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    fail(where, f"Kubernetes {version}: {e.message} at {list(e.path)}")
                except kubernetes_validate.SchemaNotFoundError as e:
                    fail(where, f"Kubernetes {version}: no schema: {e}")
            if d["kind"] == "Deployment":
                check_deployment(where, d, walbox, docs)
            if d["kind"] == "PodDisruptionBudget":
                if d["spec"].get("maxUnavailable") != 1:
                    fail(where, "the budget must let a drain take one pod of the pair")
        print(f"{name}: {len(docs)} objects ({', '.join(sorted(set(kinds)))}) valid for Kubernetes {', '.join(VERSIONS)}")
    if failures:
        print("\n".join(failures), file=sys.stderr)
        sys.exit(1)


main()
