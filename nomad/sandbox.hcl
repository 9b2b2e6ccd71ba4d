# atropos-sandbox: sandbox hosts as a Nomad service job (docker driver). Each allocation is one
# container running `python -m atropos.sandbox` with N slots; every tool call runs in a hardened,
# unprivileged bubblewrap sandbox inside it.
#
# The pool (atropos/backends/nomad/, NomadBackend) registers THIS job from code: render_job() is its
# JSON form and tests/test_nomad_backend.py checks that both stay identical. Keep them in step.
#
# Run it by hand (the pool does all of this itself; see nomad/README.md):
#   nomad var put -force nomad/jobs/atropos-sandbox token="$(head -c 32 /dev/urandom | base64 | tr -d '/+=')"
#   nomad job run -var image=atropos-sandbox:dev -var host_count=2 nomad/sandbox.hcl
#   # later scale changes: nomad job scale atropos-sandbox hosts 4
#   # re-running the file after a scale: add -preserve-counts, or the count resets to host_count
#
# Needs Nomad >= 2.0.4 on the clients (a docker-driver escape was fixed there; the constraint below
# enforces it) and the client configuration in nomad/client.hcl (runtime, seccomp profile).

variable "image" {
  type        = string
  default     = "atropos-sandbox:dev"
  description = "sandbox server image (sandbox_image/Dockerfile)"
}

variable "host_count" {
  type        = number
  default     = 1
  description = "containers (the pool registers 0 and scales the group itself)"
}

variable "slots_per_host" {
  type    = number
  default = 16
}

variable "cpu" {
  type        = number
  default     = 2000
  description = "MHz reserved per container"
}

variable "memory" {
  type        = number
  default     = 4096
  description = "MB per container: docker's hard limit; the workspace tmpfs counts against it"
}

variable "workspace_bytes" {
  type        = number
  default     = 2147483648
  description = "size of the tmpfs holding every slot's workspace"
}

variable "slot_workspace_bytes" {
  type        = number
  default     = 134217728
  description = "what one slot can write to its workspace (its own tmpfs, inside the one above)"
}

variable "pids_limit" {
  type    = number
  default = 4096
}

variable "slot_memory_bytes" {
  type        = number
  default     = 1073741824
  description = "memory one slot may hold as a whole (its processes, tmpfs and memfd pages): its own cgroup"
}

variable "slot_pids" {
  type        = number
  default     = 512
  description = "processes and threads per slot"
}

variable "slot_cpus" {
  type        = number
  default     = 1
  description = "hard CPU quota per slot, in CPUs; 0 = equal shares only"
}

variable "max_timeout_s" {
  type        = number
  default     = 600
  description = "longest per-call timeout a slot accepts"
}

variable "datacenters" {
  type    = list(string)
  default = ["*"]
}

variable "seccomp_profile" {
  type        = string
  default     = "/etc/atropos-sandbox/seccomp.json"
  description = "outer seccomp profile: a path on every client (atropos/backends/docker_seccomp.json)"
}

variable "runtime" {
  type        = string
  default     = "atropos-runc"
  description = "OCI runtime: runc that unmasks /proc for non-root, capability-less containers (nomad/atropos-runc)"
}

job "atropos-sandbox" {
  type        = "service"
  datacenters = var.datacenters

  constraint {
    attribute = "${attr.kernel.name}"
    value     = "linux"
  }

  # Nomad < 2.0.4 has a docker-driver container escape.
  constraint {
    attribute = "${attr.nomad.version}"
    operator  = "semver"
    value     = ">= 2.0.4"
  }

  group "hosts" {
    count = var.host_count

    # No deployments: a count change is applied at once and never blocks the next scale
    # ("job scaling blocked due to active deployment").
    update {
      max_parallel = 0
    }

    network {
      mode = "host"

      # Dynamic host port (HostIP:Value in the allocation) -> the server's 8080 in the container.
      port "http" {
        to = 8080
      }
    }

    # A restarted server has lost every lease, so a restart in place helps nobody: fail the
    # allocation and let Nomad reschedule it (new ID, same name); the pool adopts the replacement.
    restart {
      attempts = 0
      interval = "5m"
      delay    = "5s"
      mode     = "fail"
    }

    reschedule {
      delay          = "5s"
      delay_function = "exponential"
      max_delay      = "1m"
      unlimited      = true
    }

    task "host" {
      driver = "docker"
      # isolation.md (a): nothing in the container is uid 0 or holds a capability. This is what makes
      # the unmasked /proc (runtime below) and the namespace-friendly seccomp profile safe.
      user = "1000:1000"

      config {
        image = var.image
        ports = ["http"]
        # "--slots=${...}": a string that is only "${var.x}" would keep the number type in HCL2.
        args = [
          "--host", "0.0.0.0", "--port", "8080", "--slots=${var.slots_per_host}",
          "--data-dir", "/slots/data",
          # the slot limits, in the order atropos/sandbox/contract/launch.py (SlotLimits) declares them
          "--max-timeout=${var.max_timeout_s}", "--workspace-bytes=${var.slot_workspace_bytes}",
          "--slot-memory-bytes=${var.slot_memory_bytes}", "--slot-pids=${var.slot_pids}",
          "--slot-cpus=${var.slot_cpus}",
          # per-slot cgroups: the runtime (atropos-runc) sees this flag and delegates a cgroup subtree,
          # nested in the container's own limits, mounted here (nomad/README.md)
          "--cgroup-dir=/run/atropos/cgroup",
          # the host token: a file in this task's secrets dir (the template below), read once and removed
          "--token-file=${NOMAD_SECRETS_DIR}/token",
          # the host sees only the container's addresses: network slots must not reach the node's
          # either (egress policy, docs/containment.md); Nomad fills in the node's address
          "--egress-machine-address=${attr.unique.network.ip-address}",
        ]
        init     = true
        cap_drop = ["ALL"]
        # resources.cpu below is only a share (CPU weight) unless this makes it a CFS quota: a hard cap,
        # so one busy host cannot starve its neighbours (isolation.md).
        cpu_hard_limit = true
        # seccomp=<path> is read on the client and inlined by Nomad. Docker's
        # `--security-opt systempaths=unconfined` is a CLI option: the Engine API that Nomad calls
        # rejects it ("invalid --security-opt 2"), so /proc is unmasked by the runtime instead.
        security_opt    = ["no-new-privileges", "seccomp=${var.seccomp_profile}"]
        runtime         = var.runtime
        readonly_rootfs = true
        pids_limit      = var.pids_limit

        # slirp4netns: slots leased with network get their own network namespace behind NAT
        # (atropos.sandbox.network); without the device they share the container's namespace.
        devices = [
          {
            host_path      = "/dev/net/tun"
            container_path = "/dev/net/tun"
          }
        ]

        # mode is decimal (HCL has no octal): 1023 = 01777. The server creates /slots/data as uid 1000.
        mount {
          type     = "tmpfs"
          target   = "/tmp"
          readonly = false
          tmpfs_options {
            size = 67108864
            mode = 1023
          }
        }

        mount {
          type     = "tmpfs"
          target   = "/slots"
          readonly = false
          tmpfs_options {
            size = var.workspace_bytes
            mode = 1023
          }
        }
      }

      # The host token: the Nomad variable nomad/jobs/<job ID> (keep it in step with the job's name),
      # which only this job's tasks can read (workload identity), rendered into a file in the task's
      # secrets dir (per task, tmpfs, mounted into no other task): mode 0400 and the task's uid (Nomad
      # writes templates as its agent's user otherwise). Never into the environment: any process of
      # the same uid can read /proc/<pid>/environ. The server refuses a token file others can read,
      # reads it once and removes it; slots never see /secrets. No variable, no start.
      template {
        data        = "{{ with nomadVar \"nomad/jobs/atropos-sandbox\" }}{{ .token }}{{ end }}\n"
        destination = "secrets/token"
        perms       = "0400"
        uid         = 1000
        gid         = 1000
        change_mode = "noop"
      }

      resources {
        cpu    = var.cpu
        memory = var.memory
      }

      kill_timeout = "10s"
    }
  }
}
