"""Checks rendered Kubernetes manifests of walbox's chart (run by deploy/check).

Usage: check.py WALBOX_BIN PROMTOOL FILE...

Every object passes kubernetes-validate's strict schemas (Kubernetes 1.28 and
the newest the package carries); prometheus-operator objects, which it has no
schema for, are checked by promtool (the rules) and by shape. Then what walbox
relies on: numeric non-root user, read-only root filesystem, no
capabilities, a grace period above walbox's shutdown bound, the probes, a
rollout that can finish with a standby, the disruption budget, a
walbox.toml that `walbox config` accepts, every file walbox is told to read
(TLS files, secret files) on a mounted volume, secret files not readable by
others, no secret value in a pod spec, and the hook Job's pod outside the
Deployment's selector.
"""

import os
import re
import shutil
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


SECRET_VARIABLES = re.compile(r"^(WALBOX_PG_URL|PGPASSWORD|WALBOX_.*(PASSWORD|SECRET|TOKEN)(?!.*_FILE$).*)$")
FILE_VARIABLES = re.compile(r"^(PGSSLROOTCERT|PGSSLCERT|PGSSLKEY|PGPASSFILE|WALBOX_.*_FILE)$")


def walbox_container(where, pod):
    named = [c for c in pod["containers"] if c["name"] in ("walbox", "init-slot", "migrate", "doctor")]
    if len(named) != 1:
        fail(where, f"expected one walbox container, found {[c['name'] for c in pod['containers']]}")
        return pod["containers"][0]
    return named[0]


def check_security(where, pod, containers):
    psc = pod.get("securityContext", {})
    if not isinstance(psc.get("runAsUser"), int) or psc["runAsUser"] == 0:
        fail(where, f"runAsUser must be a numeric non-root UID, is {psc.get('runAsUser')!r}")
    if psc.get("runAsNonRoot") is not True:
        fail(where, "runAsNonRoot must be true")
    if pod.get("automountServiceAccountToken") is not False:
        fail(where, "the service account token must not be mounted")
    for c in containers:
        sc = c.get("securityContext", {})
        if sc.get("readOnlyRootFilesystem") is not True:
            fail(where, f"{c['name']}: readOnlyRootFilesystem must be true")
        if sc.get("allowPrivilegeEscalation") is not False:
            fail(where, f"{c['name']}: allowPrivilegeEscalation must be false")
        if sc.get("capabilities", {}).get("drop") != ["ALL"]:
            fail(where, f"{c['name']}: capabilities must drop ALL")
        for e in c.get("env", []):
            if SECRET_VARIABLES.match(e["name"]) and "value" in e:
                fail(where, f"{c['name']}: {e['name']} has its value in the pod spec (use the Secret)")


def files_read(toml_text, c):
    """Every file walbox is told to read: (what, path)."""
    paths = []
    for line in toml_text.splitlines():
        m = re.match(r'\s*"?([a-z.]+\.location|[a-z_]+_file)"?\s*=\s*"([^"]+)"', line)
        if m:
            paths.append((m.group(1), m.group(2)))
    for e in c.get("env", []):
        if FILE_VARIABLES.match(e["name"]) and "value" in e:
            paths.append((e["name"], e["value"]))
    return paths


def check_files(where, pod, c, toml_text):
    """Each file walbox reads is on a volume mounted into its container;
    secret volumes keep their files from others."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = c.get("volumeMounts", [])
    for m in mounts:
        if m["name"] not in volumes:
            fail(where, f"volumeMount {m['name']} has no volume")
    paths = sorted(m["mountPath"] for m in mounts)
    for a, b in zip(paths, paths[1:]):
        if b.startswith(a.rstrip("/") + "/"):
            fail(where, f"{b} is mounted inside {a} (mount them side by side)")
    for what, path in files_read(toml_text, c):
        under = [m for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/")]
        if not under:
            fail(where, f"{what} = {path} is on no mounted volume")
            continue
        m = max(under, key=lambda m: len(m["mountPath"]))
        volume = volumes.get(m["name"], {})
        source = volume.get("secret") or volume.get("configMap")
        name = path[len(m["mountPath"].rstrip("/")) + 1:]
        if source and source.get("items") and name not in [i["path"] for i in source["items"]]:
            fail(where, f"{what} = {path}: volume {m['name']} projects no {name}")
        if "secret" in volume and re.search(r"(key|_FILE)", what + path):
            mode = volume["secret"].get("defaultMode", 0o644)
            if mode & 0o077:
                fail(where, f"{what} = {path}: secret volume {m['name']} has mode {mode:o}, readable by others (use 0400)")


def self_signed(root):
    """A throwaway self-signed certificate and its key, PEM, by openssl."""
    d = tempfile.mkdtemp(dir=root)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=stand-in", "-keyout", f"{d}/key.pem", "-out", f"{d}/cert.pem"],
        check=True, capture_output=True,
    )
    with open(f"{d}/cert.pem") as cert, open(f"{d}/key.pem") as key:
        return {"cert": cert.read(), "key": key.read()}


def walbox_config(where, c, toml_text, walbox):
    """`walbox config` on the rendered walbox.toml, with the mounted files
    stood in by empty ones under a temporary root. None if it refuses."""
    root = tempfile.mkdtemp()
    try:
        def local(path):
            return os.path.join(root, path.lstrip("/"))
        pem = None
        for what, path in files_read(toml_text, c):
            os.makedirs(os.path.dirname(local(path)), exist_ok=True)
            text = ""
            kafka_pem = re.search(r"ssl\.(ca|certificate|key)\.location$", what)
            if re.fullmatch(r"(ca|cert|key)_file", what) or kafka_pem:
                # walbox reads these when it checks the configuration (and
                # librdkafka loads its own): stand-ins it can parse (a
                # throwaway self-signed pair).
                pem = pem or self_signed(root)
                key = what == "key_file" or what.endswith("ssl.key.location")
                text = pem["key" if key else "cert"]
            with open(local(path), "w") as f:
                f.write(text)
            os.chmod(local(path), 0o400)
        text = toml_text
        for _, path in files_read(toml_text, c):
            text = text.replace(f'"{path}"', f'"{local(path)}"')
        config = os.path.join(root, "walbox.toml")
        with open(config, "w") as f:
            f.write(text)
        env = dict(os.environ, WALBOX_PG_URL="host=db user=walbox dbname=app")
        for e in c.get("env", []):
            # The Secret's values are not here: they are not checked.
            if "value" in e and e["name"] != "WALBOX_PG_URL_FILE":
                env[e["name"]] = local(e["value"]) if FILE_VARIABLES.match(e["name"]) else e["value"]
        env.pop("WALBOX_PG_URL_FILE", None)
        out = subprocess.run(
            [walbox, "config", "--config", config], env=env, capture_output=True, text=True
        )
        if out.returncode != 0:
            fail(where, f"walbox refuses the rendered walbox.toml: {out.stderr.strip()}")
            return None
        return out.stdout
    finally:
        shutil.rmtree(root)


def config_map(docs, name):
    for doc in docs:
        if doc and doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == name:
            return doc["data"]["walbox.toml"]
    return None


def check_pod(where, pod, walbox, docs):
    c = walbox_container(where, pod)
    check_security(where, pod, [c] + pod.get("initContainers", []))
    config = next(v for v in pod["volumes"] if v["name"] == "config")["configMap"]["name"]
    toml_text = config_map(docs, config)
    if toml_text is None:
        fail(where, f"no ConfigMap {config}")
        return None
    check_files(where, pod, c, toml_text)
    return walbox_config(where, c, toml_text, walbox)


def check_deployment(where, d, walbox, docs):
    spec = d["spec"]
    pod = spec["template"]["spec"]
    c = walbox_container(where, pod)
    if c["livenessProbe"]["httpGet"]["path"] != "/healthz":
        fail(where, "liveness must probe /healthz")
    if c["readinessProbe"]["httpGet"]["path"] != "/readyz?standby=ready":
        fail(where, "readiness must probe /readyz?standby=ready (a waiting standby is ready)")
    if c.get("startupProbe", {}).get("httpGet", {}).get("path") != "/healthz":
        fail(where, "the startup probe must probe /healthz")
    if not any(e["name"] == "PGAPPNAME" and e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name" for e in c["env"]):
        fail(where, "application_name must be the pod's name (PGAPPNAME from metadata.name)")
    # A rollout must not wait for a pod that cannot become ready: with the
    # standby ready, surge 1 / unavailable 0 finishes; anything else must be
    # Recreate.
    strategy = spec.get("strategy", {})
    if strategy.get("type") == "RollingUpdate":
        if strategy["rollingUpdate"].get("maxUnavailable") != 0:
            fail(where, "the rolling update must keep the active pod until a standby is ready")
    out = check_pod(where, pod, walbox, docs)
    if out is None:
        return
    # walbox exits within shutdown_timeout_secs + 6 s of SIGTERM.
    shutdown = next(
        int(line.split("=")[1].split()[0])
        for line in out.splitlines()
        if line.startswith("shutdown_timeout_secs")
    )
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if grace <= shutdown + 6:
        fail(where, f"terminationGracePeriodSeconds {grace} is not above walbox's bound {shutdown} + 6 s")


def check_job(where, job, walbox, docs, deployment):
    pod = job["spec"]["template"]
    hooks = job["metadata"].get("annotations", {}).get("helm.sh/hook", "")
    if "pre-install" not in hooks or "pre-upgrade" not in hooks:
        fail(where, f"the Job must be a pre-install,pre-upgrade hook, is {hooks!r}")
    if pod["spec"].get("restartPolicy") != "Never":
        fail(where, "the hook's pod must not restart in place (restartPolicy Never)")
    if deployment is not None:
        selector = deployment["spec"]["selector"]["matchLabels"]
        labels = pod["metadata"].get("labels", {})
        if all(labels.get(k) == v for k, v in selector.items()):
            fail(where, "the hook's pod matches the Deployment's selector")
    check_pod(where, pod["spec"], walbox, docs)


def check_dashboard(where, text):
    """The dashboard imports (its DS_PROMETHEUS input is what every query
    uses), selects by namespace and job, and each panel has one unit."""
    import json
    d = json.loads(text)
    names = [v["name"] for v in d["templating"]["list"]]
    if [i["name"] for i in d.get("__inputs", [])] != ["DS_PROMETHEUS"] or "DS_PROMETHEUS" not in names:
        fail(where, "the dashboard must declare and use the DS_PROMETHEUS input")
    for want in ["namespace", "job"]:
        if want not in names:
            fail(where, f"the dashboard has no {want} variable")
    for p in d["panels"]:
        uids = {t.get("datasource", p.get("datasource", {})).get("uid") for t in p["targets"]} | {p.get("datasource", {}).get("uid")}
        if uids != {"${DS_PROMETHEUS}"}:
            fail(where, f"panel {p['title']!r} uses data sources {uids}")
        if not p.get("fieldConfig", {}).get("defaults", {}).get("unit"):
            fail(where, f"panel {p['title']!r} has no unit")
        for o in p.get("fieldConfig", {}).get("overrides") or []:
            if any(prop.get("id") == "unit" for prop in o.get("properties", [])):
                fail(where, f"panel {p['title']!r} mixes units (an override sets another)")
        for t in p["targets"]:
            if '$job' in t["expr"] and '$namespace' not in t["expr"]:
                fail(where, f"panel {p['title']!r}: {t['expr']} ignores the namespace")


def check_dockerfile(path):
    """The image the chart runs: pinned builder, dependencies in a layer of
    their own, distroless runtime as the UID the chart's runAsUser names.
    (No Docker engine here: the rules are checked, the build is not.)"""
    lines = [l.strip() for l in open(path) if l.strip() and not l.lstrip().startswith("#")]
    froms = [l.split()[1] for l in lines if l.upper().startswith("FROM ")]
    builder, runtime = froms[0], froms[-1]
    if not re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+-\w+(@sha256:[0-9a-f]{64})?", builder):
        fail(path, f"the builder image {builder} is not pinned to a full version")
    if not runtime.startswith("gcr.io/distroless/") or not runtime.endswith(":nonroot"):
        fail(path, f"the runtime image {runtime} is not distroless nonroot")
    cook = next((i for i, l in enumerate(lines) if "cargo chef cook" in l), None)
    copy_all = [i for i, l in enumerate(lines) if l.startswith("COPY . .")]
    if cook is None or not any(i > cook for i in copy_all):
        fail(path, "dependencies are not built in their own layer before the sources are copied")
    users = [l.split()[1] for l in lines if l.upper().startswith("USER ")]
    if users[-1:] != ["65532:65532"]:
        fail(path, f"the image must run as 65532:65532 (the chart's runAsUser), runs as {users}")
    if not any(l.startswith("ENTRYPOINT") and "/usr/local/bin/walbox" in l for l in lines):
        fail(path, "the entrypoint must be walbox by its path (no shell in the image)")
    # What runs the image must not need a shell it does not have.
    with open("docker-compose.yml") as f:
        services = yaml.safe_load(f)["services"]
    for name, service in services.items():
        if service.get("build") == "." and "sh" in (service.get("entrypoint") or []):
            fail("docker-compose.yml", f"service {name} runs a shell the image does not have")


def main():
    walbox, promtool, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    check_dockerfile("Dockerfile")
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
            if d["kind"] == "ConfigMap" and "walbox.json" in d.get("data", {}):
                check_dashboard(where, d["data"]["walbox.json"])
            if d["kind"] == "Job":
                deployment = next((x for x in docs if x["kind"] == "Deployment"), None)
                check_job(where, d, walbox, docs, deployment)
            if d["kind"] == "PodDisruptionBudget":
                # A drain may take one pod at a time, never every pod.
                deployment = next((x for x in docs if x["kind"] == "Deployment"), {})
                replicas = deployment.get("spec", {}).get("replicas", 1)
                spec = d["spec"]
                if "minAvailable" in spec:
                    allowed = replicas - int(spec["minAvailable"])
                else:
                    allowed = spec.get("maxUnavailable")
                if allowed is None or not 1 <= allowed < max(replicas, 2):
                    fail(where, f"the budget must let a drain take one pod of the {replicas}, and not all of them")
        print(f"{name}: {len(docs)} objects ({', '.join(sorted(set(kinds)))}) valid for Kubernetes {', '.join(VERSIONS)}")
    if failures:
        print("\n".join(failures), file=sys.stderr)
        sys.exit(1)


main()
