"""launcher.job=kubernetes: one MonarchMesh resource per role, provisioned by the Monarch operator
through Monarch's KubernetesJob; and what it submits, rendered without a cluster.

    python -m pipeline.cluster.manifest --config configs/x.yaml run.launcher=monarch launcher.job=kubernetes ...
        # prints the MonarchMesh manifests (YAML) the run would create; nothing is applied

Each role's mesh is named <launcher.name without '-'><role> (MonarchMesh names are lowercase
letters and digits), with launcher.*_hosts replicas of the worker image launcher.kubernetes.image,
the resources asked for (cpu, memory, nvidia.com/gpu = launcher.devices_per_host) as requests and
limits, and a memory-backed /dev/shm when launcher.kubernetes.shm is set. The pod template is the one
Monarch's KubernetesJob builds (its worker bootstrap on launcher.kubernetes.port). The run needs the
`kubernetes` package (make setup installs it) and, in the cluster, the Monarch operator's MonarchMesh
resource definition.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeline.config import ConfigError, load_config

GROUP, VERSION = "monarch.pytorch.org", "v1alpha1"


def mesh_name(cfg: Any, role: str) -> str:
    return cfg.launcher.name.replace("-", "") + role if cfg.launcher.job == "kubernetes" else role


def resources(cfg: Any) -> dict[str, str]:
    kc, out = cfg.launcher.kubernetes, {}
    if kc.cpu:
        out["cpu"] = kc.cpu
    if kc.memory:
        out["memory"] = kc.memory
    if cfg.launcher.devices_per_host:
        out["nvidia.com/gpu"] = str(cfg.launcher.devices_per_host)
    return out


def manifests(cfg: Any) -> list[dict]:
    """The MonarchMesh resources launcher.job=kubernetes creates, one per role (as dicts): the body
    Monarch's KubernetesJob submits, with its own pod template."""
    from kubernetes import client
    from monarch._src.job.kubernetes import ImageSpec, KubernetesJob
    from monarch._src.job.service_identity import allocate_service_proc_ids

    kc, out = cfg.launcher.kubernetes, []
    image = ImageSpec(kc.image, resources=resources(cfg) or None, shared_memory_size=kc.shm or None)
    for role, n in cfg.launcher.hosts().items():
        pod = KubernetesJob._build_worker_pod_template(image, kc.port, allocate_service_proc_ids(n))
        out.append({"apiVersion": f"{GROUP}/{VERSION}", "kind": "MonarchMesh",
                    "metadata": {"name": mesh_name(cfg, role), "namespace": kc.namespace, "labels": labels(cfg, role)},
                    "spec": {"replicas": n, "port": kc.port,
                             "podTemplate": client.ApiClient().sanitize_for_serialization(pod)}})
    return out


def labels(cfg: Any, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": cfg.launcher.name, "pipeline-role": role}


def kubernetes_job(cfg: Any, meshes: dict[str, int]) -> Any:
    """Monarch's KubernetesJob with one provisioned mesh per role (needs the `kubernetes` package)."""
    try:
        from monarch._src.job.kubernetes import ImageSpec, KubeConfig, KubernetesJob
        import kubernetes  # noqa: F401
    except ImportError:
        raise ConfigError("config: launcher.job='kubernetes' is invalid; allowed: with the kubernetes package "
                          "installed (pip install kubernetes)") from None
    kc = cfg.launcher.kubernetes
    job = KubernetesJob(namespace=kc.namespace, timeout=int(cfg.launcher.start_timeout_s),
                        kubeconfig=KubeConfig.from_path(kc.kubeconfig) if kc.kubeconfig else None)
    for role, n in meshes.items():
        job.add_mesh(mesh_name(cfg, role), n, port=kc.port,
                     image_spec=ImageSpec(kc.image, resources=resources(cfg) or None,
                                          shared_memory_size=kc.shm or None),
                     labels=labels(cfg, role))
    return job


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.cluster.manifest",
                                 description="Print the MonarchMesh manifests a launcher.job=kubernetes run creates.")
    ap.add_argument("--config", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, ["run.launcher=monarch", "launcher.job=kubernetes", *args.overrides])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import yaml

    print(yaml.safe_dump_all(manifests(cfg), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
