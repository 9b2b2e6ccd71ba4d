# Nomad client configuration the atropos-sandbox job needs (merge into the client's config, or pass
# with -config=; docker-compose.yml mounts it into the dev agent). See nomad/README.md.

plugin "docker" {
  config {
    # The job names runtime = "atropos-runc" (runc with /proc unmasked, nomad/atropos-runc); dockerd
    # must know it too (/etc/docker/daemon.json "runtimes"). Keep runc for everything else.
    allow_runtimes = ["runc", "atropos-runc"]

    # The job adds no capability (cap_drop = ["ALL"]) and is not privileged: keep the default
    # allow_caps list and allow_privileged = false. Neither needs changing for the sandbox.
    allow_privileged = false

    # Only tmpfs mounts are used; host volumes stay disabled.
    volumes {
      enabled = false
    }

    # Label containers so an operator can find them with `docker ps --filter label=...`.
    extra_labels = ["job_name", "task_group_name", "task_name", "namespace", "node_name"]
  }
}
