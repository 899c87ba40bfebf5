//! The launch environment: who this process is and where the rendezvous store lives,
//! from the variables torchrun, `tpar-run`, `srun` and `mpirun` set; and the world built
//! from it (PyTorch's `init_process_group("nccl")` or `init_process_group("gloo")`),
//! on the `nccl` or the `tcp` backend.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use tpar_collectives::{nccl, CollectiveError, ProcessGroup};

use crate::rendezvous::{RendezvousError, Result, TcpStore, TorchStoreClient};

/// Which launcher's variables gave a process its rank and world size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EnvSource {
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`: torchrun, `tpar-run`, or set by hand.
    #[default]
    Torch,
    /// Slurm's `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`.
    Slurm,
    /// Open MPI's `mpirun`: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`.
    OpenMpi,
}

/// `MASTER_PORT` under `srun` when it is not set: `29500 + SLURM_JOB_ID % 1000` (29500
/// without a job id), so that jobs sharing a node pick different ports.
pub const SLURM_DEFAULT_PORT_BASE: u16 = 29500;

/// `MASTER_PORT` under Open MPI's `mpirun` when it is not set (torchrun's default).
pub const MPI_DEFAULT_PORT: u16 = 29500;

/// The launch environment torchrun, `srun`, `mpirun` and `tpar-run` give each
/// process: who it is and where the rendezvous store lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvInit {
    /// Global rank, `RANK`.
    pub rank: usize,
    /// Number of processes in the job, `WORLD_SIZE`.
    pub world_size: usize,
    /// Rank within this node, `LOCAL_RANK` (selects the GPU).
    pub local_rank: usize,
    /// Processes on this node, `LOCAL_WORLD_SIZE` (optional).
    pub local_world_size: Option<usize>,
    /// Host of rank 0's store, `MASTER_ADDR`.
    pub master_addr: String,
    /// Port of rank 0's store, `MASTER_PORT`.
    pub master_port: u16,
    /// Which launcher's variables these are.
    pub source: EnvSource,
    /// torchrun's agent already serves a PyTorch `TCPStore` at `MASTER_ADDR:MASTER_PORT`
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`): [`store`](Self::store) joins it as a client
    /// instead of binding that port.
    pub agent_store: bool,
    /// How many times the launcher restarted the job, `TORCHELASTIC_RESTART_COUNT` (0
    /// when unset).
    pub restart_count: u64,
    /// The launcher's job id, `TORCHELASTIC_RUN_ID` (optional).
    pub run_id: Option<String>,
}

impl EnvInit {
    /// Reads the launch environment of this process: `RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`, `LOCAL_WORLD_SIZE` (optional), `MASTER_ADDR` and `MASTER_PORT`
    /// (torchrun, `tpar-run`); when `RANK` and `WORLD_SIZE` are both unset, Slurm's
    /// (`srun`) or Open MPI's (`mpirun`) variables instead (see
    /// [`from_vars`](Self::from_vars)). A missing or invalid variable is an error
    /// naming it.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// [`from_env`](Self::from_env) over any variable source (tests, config files).
    ///
    /// - torchrun and `tpar-run`: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    ///   `MASTER_PORT` are required, `LOCAL_WORLD_SIZE` optional. torchrun's
    ///   `TORCHELASTIC_USE_AGENT_STORE`, `TORCHELASTIC_RESTART_COUNT` and
    ///   `TORCHELASTIC_RUN_ID` are read too.
    /// - `srun` (used when `RANK` and `WORLD_SIZE` are unset and `SLURM_PROCID` is set):
    ///   `SLURM_PROCID`, `SLURM_NTASKS` and `SLURM_LOCALID`; the tasks on this node from
    ///   `SLURM_TASKS_PER_NODE` (`2(x3),1`) and `SLURM_NODEID`; `MASTER_ADDR`, or else the
    ///   first host of `SLURM_JOB_NODELIST` (or `SLURM_NODELIST`), a Slurm host list such
    ///   as `node[01-04,07],gpu3`; `MASTER_PORT`, or else
    ///   `29500 + SLURM_JOB_ID % 1000` ([`SLURM_DEFAULT_PORT_BASE`]).
    /// - Open MPI's `mpirun` (when `OMPI_COMM_WORLD_RANK` is set):
    ///   `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`,
    ///   `OMPI_COMM_WORLD_LOCAL_SIZE`; `MASTER_ADDR`, or else `127.0.0.1` when every rank
    ///   is on this node (pass it with `mpirun -x MASTER_ADDR=host` otherwise);
    ///   `MASTER_PORT`, or else 29500 ([`MPI_DEFAULT_PORT`]).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let var = |name: &str| var(name).map(|v| v.trim().to_string());
        let get = |name: &'static str| var(name).ok_or(RendezvousError::MissingEnv { var: name });
        let number = |name: &'static str, value: String| {
            value
                .parse::<usize>()
                .map_err(|e| invalid(name, &value, format!("not a non-negative integer ({e})")))
        };
        let optional = |name: &'static str| match var(name) {
            None => Ok(None),
            Some(v) => number(name, v).map(Some),
        };
        let port = |name: &'static str, text: String| {
            text.parse::<u16>()
                .map_err(|e| invalid(name, &text, format!("not a port number ({e})")))
        };
        let torch_vars = var("RANK").is_some() || var("WORLD_SIZE").is_some();
        let source = if torch_vars {
            EnvSource::Torch
        } else if var("SLURM_PROCID").is_some() {
            EnvSource::Slurm
        } else if var("OMPI_COMM_WORLD_RANK").is_some() {
            EnvSource::OpenMpi
        } else {
            EnvSource::Torch
        };
        let (rank, world_size, local_rank, local_world_size, master_addr, master_port) =
            match source {
                EnvSource::Torch => (
                    number("RANK", get("RANK")?)?,
                    number("WORLD_SIZE", get("WORLD_SIZE")?)?,
                    number("LOCAL_RANK", get("LOCAL_RANK")?)?,
                    optional("LOCAL_WORLD_SIZE")?,
                    get("MASTER_ADDR")?,
                    port("MASTER_PORT", get("MASTER_PORT")?)?,
                ),
                EnvSource::Slurm => {
                    let rank = number("SLURM_PROCID", get("SLURM_PROCID")?)?;
                    let world = number("SLURM_NTASKS", get("SLURM_NTASKS")?)?;
                    let local_rank = number("SLURM_LOCALID", get("SLURM_LOCALID")?)?;
                    let local_world = match (var("SLURM_TASKS_PER_NODE"), optional("SLURM_NODEID")?)
                    {
                        (Some(t), Some(node)) => slurm_tasks_on_node(&t, node),
                        _ => None,
                    };
                    let master_addr = match var("MASTER_ADDR") {
                        Some(a) => a,
                        None => {
                            let (name, list) = match var("SLURM_JOB_NODELIST") {
                                Some(l) => ("SLURM_JOB_NODELIST", l),
                                None => (
                                    "SLURM_NODELIST",
                                    var("SLURM_NODELIST").ok_or(RendezvousError::MissingEnv {
                                        var: "MASTER_ADDR",
                                    })?,
                                ),
                            };
                            first_slurm_host(&list).ok_or_else(|| {
                                invalid(name, &list, "not a Slurm host list".into())
                            })?
                        }
                    };
                    let master_port = match var("MASTER_PORT") {
                        Some(p) => port("MASTER_PORT", p)?,
                        None => {
                            let job = optional("SLURM_JOB_ID")?.unwrap_or(0);
                            SLURM_DEFAULT_PORT_BASE + (job % 1000) as u16
                        }
                    };
                    (rank, world, local_rank, local_world, master_addr, master_port)
                }
                EnvSource::OpenMpi => {
                    let rank = number("OMPI_COMM_WORLD_RANK", get("OMPI_COMM_WORLD_RANK")?)?;
                    let world = number("OMPI_COMM_WORLD_SIZE", get("OMPI_COMM_WORLD_SIZE")?)?;
                    let local_rank =
                        number("OMPI_COMM_WORLD_LOCAL_RANK", get("OMPI_COMM_WORLD_LOCAL_RANK")?)?;
                    let local_world = optional("OMPI_COMM_WORLD_LOCAL_SIZE")?;
                    let master_addr = match (var("MASTER_ADDR"), local_world) {
                        (Some(a), _) => a,
                        (None, Some(lws)) if lws == world => "127.0.0.1".to_string(),
                        (None, Some(lws)) => {
                            return Err(invalid(
                                "OMPI_COMM_WORLD_LOCAL_SIZE",
                                &lws.to_string(),
                                format!(
                                    "the {world} ranks span several nodes: set MASTER_ADDR to \
                                     rank 0's host (mpirun -x MASTER_ADDR=host)"
                                ),
                            ))
                        }
                        (None, None) => get("MASTER_ADDR")?,
                    };
                    let master_port = match var("MASTER_PORT") {
                        Some(p) => port("MASTER_PORT", p)?,
                        None => MPI_DEFAULT_PORT,
                    };
                    (rank, world, local_rank, local_world, master_addr, master_port)
                }
            };
        let (rank_var, world_var, local_var, lws_var) = match source {
            EnvSource::Torch => ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
            EnvSource::Slurm => {
                ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE")
            }
            EnvSource::OpenMpi => (
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ),
        };

        if world_size == 0 {
            return Err(invalid(world_var, "0", "must be at least 1".into()));
        }
        if rank >= world_size {
            return Err(invalid(
                rank_var,
                &rank.to_string(),
                format!("must be below {world_var}={world_size}"),
            ));
        }
        if let Some(lws) = local_world_size {
            if lws == 0 || lws > world_size {
                return Err(invalid(
                    lws_var,
                    &lws.to_string(),
                    format!("must be between 1 and {world_var}={world_size}"),
                ));
            }
            if local_rank >= lws {
                return Err(invalid(
                    local_var,
                    &local_rank.to_string(),
                    format!("must be below {lws_var}={lws}"),
                ));
            }
        } else if local_rank >= world_size {
            return Err(invalid(
                local_var,
                &local_rank.to_string(),
                format!("must be below {world_var}={world_size}"),
            ));
        }
        if master_addr.is_empty() {
            return Err(invalid("MASTER_ADDR", "", "is empty".into()));
        }
        if master_port == 0 {
            return Err(invalid("MASTER_PORT", "0", "must be between 1 and 65535".into()));
        }
        let agent_store = var("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True");
        let restart_count = match var("TORCHELASTIC_RESTART_COUNT") {
            None => 0,
            Some(v) => v.parse::<u64>().map_err(|e| {
                invalid(
                    "TORCHELASTIC_RESTART_COUNT",
                    &v,
                    format!("not a non-negative integer ({e})"),
                )
            })?,
        };
        let run_id = var("TORCHELASTIC_RUN_ID").filter(|v| !v.is_empty());
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            source,
            agent_store,
            restart_count,
            run_id,
        })
    }

    /// `MASTER_ADDR:MASTER_PORT`, with IPv6 literals bracketed.
    pub fn master_endpoint(&self) -> String {
        host_port(&self.master_addr, self.master_port)
    }

    /// Connects to the job's store: rank 0 starts the server and the others
    /// connect to it (retrying until `timeout`, since rank 0 may start
    /// later). `timeout` becomes the store's default timeout.
    ///
    /// The rank then joins the store ([`TcpStore::join`]) with `RANK` and `WORLD_SIZE`:
    /// a world size other than rank 0's, or a rank another process holds, is a
    /// [`RendezvousError::JobMismatch`] naming both values, here and in every other rank's
    /// next wait in the store; and if this process dies, the others' waits in the store
    /// fail at once with [`RendezvousError::RankGone`] naming its rank.
    ///
    /// Rank 0 binds `MASTER_ADDR` itself when it names a loopback address,
    /// and every interface (at `MASTER_PORT`) otherwise, so that a host name
    /// that resolves to a loopback alias on the master (a common
    /// `/etc/hosts` entry) still reaches it from other nodes.
    ///
    /// Under torchrun's agent store ([`agent_store`](Self::agent_store): every
    /// rendezvous mode of torchrun, `--standalone`, a static `--master-port` and
    /// `--rdzv-backend c10d`), `MASTER_PORT` is already taken by the agent's PyTorch
    /// `TCPStore`. Then every rank joins that store as a client
    /// ([`TorchStoreClient`]); rank 0 starts its store on a free port (of the interface
    /// that reaches the agent, or every interface) and publishes `host:port` there under
    /// `tpar/<TORCHELASTIC_RUN_ID>/<TORCHELASTIC_RESTART_COUNT>/store`, so that a
    /// restarted job never reads a stale address; the others read it and connect. The
    /// agent's store only carries that address: the job's own keys, counters and
    /// barriers live in rank 0's [`TcpStore`] as in every other launch.
    pub fn store(&self, timeout: Duration) -> Result<TcpStore> {
        let store = self.connect_store(timeout)?;
        store.join(self.rank, self.world_size)?;
        Ok(store)
    }

    /// [`store`](Self::store) before the rank joins it.
    fn connect_store(&self, timeout: Duration) -> Result<TcpStore> {
        if self.agent_store {
            return self.store_via_agent(timeout);
        }
        if self.rank != 0 {
            return TcpStore::client(&self.master_endpoint(), timeout);
        }
        let resolved: Vec<SocketAddr> = (self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .map_err(|e| RendezvousError::InvalidEnv {
                var: "MASTER_ADDR",
                value: self.master_addr.clone(),
                why: format!("does not resolve ({e})"),
            })?
            .collect();
        let bind = match resolved.first() {
            Some(a) if resolved.iter().all(|a| a.ip().is_loopback()) => *a,
            Some(a) if a.is_ipv6() => {
                SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), self.master_port)
            }
            _ => SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), self.master_port),
        };
        TcpStore::server(&bind.to_string(), self.world_size, timeout)
    }

    /// The key under which rank 0 publishes its store's address in the agent's store.
    pub fn agent_store_key(&self) -> String {
        format!("tpar/{}/{}/store", self.run_id.as_deref().unwrap_or("none"), self.restart_count)
    }

    /// [`store`](Self::store) under torchrun's agent store.
    fn store_via_agent(&self, timeout: Duration) -> Result<TcpStore> {
        let agent = TorchStoreClient::connect(&self.master_endpoint(), timeout)?;
        let key = self.agent_store_key();
        if self.rank != 0 {
            let value = agent.get_timeout(&key, timeout)?;
            let addr = String::from_utf8(value).map_err(|e| RendezvousError::Protocol {
                addr: agent.addr().to_string(),
                what: format!("value of {key:?} is not UTF-8: {e}"),
            })?;
            return TcpStore::client(&addr, timeout);
        }
        // The interface that reaches the agent reaches rank 0 from the other nodes too.
        let ip = agent.local_addr().map(|a| a.ip()).unwrap_or(Ipv4Addr::LOCALHOST.into());
        let bind = match ip {
            ip if ip.is_loopback() => SocketAddr::new(ip, 0),
            IpAddr::V6(_) => SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), 0),
            IpAddr::V4(_) => SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0),
        };
        let store = TcpStore::server(&bind.to_string(), self.world_size, timeout)?;
        let port = store.local_addr().map_or(0, |a| a.port());
        agent.set(&key, host_port(&ip.to_string(), port).as_bytes())?;
        Ok(store)
    }

    /// The NCCL world group of this process: connects to the job's store
    /// ([`store`](Self::store)) and calls
    /// [`ProcessGroup::nccl_world`](tpar_collectives::ProcessGroup::nccl_world) with
    /// `RANK`, `WORLD_SIZE` and device `LOCAL_RANK`. `timeout` bounds the setup and is
    /// the group's collective timeout.
    ///
    /// The CUDA driver and NCCL are probed first, so a machine without them gets
    /// [`CollectiveError::Unavailable`] naming the missing library, and binds no port. A
    /// store that cannot be reached is a [`CollectiveError::Backend`] error of op
    /// `"init"` whose message holds the [`RendezvousError`]. Rank 0 hosts the store: call
    /// `barrier()` on the world before it exits.
    pub fn nccl_world(
        &self,
        timeout: Duration,
    ) -> std::result::Result<ProcessGroup, CollectiveError> {
        nccl::probe().check()?;
        let store = self.store(timeout).map_err(|e| CollectiveError::Backend {
            backend: "nccl",
            op: "init",
            group: (0..self.world_size).collect(),
            rank: self.rank,
            message: format!("rendezvous: {e}"),
        })?;
        ProcessGroup::nccl_world(
            Arc::new(store),
            self.rank,
            self.world_size,
            self.local_rank,
            timeout,
        )
    }

    /// The TCP world group of this process: connects to the job's store
    /// ([`store`](Self::store)) and calls
    /// [`ProcessGroup::tcp_world`](tpar_collectives::ProcessGroup::tcp_world) with `RANK`
    /// and `WORLD_SIZE` (`LOCAL_RANK` is not used: tensors live on the host). `timeout`
    /// bounds the setup and is the group's collective timeout.
    ///
    /// Each process advertises the local address of its connection to the store (the
    /// interface that reaches `MASTER_ADDR`) to its peers, unless
    /// [`TCP_HOST_ENV`](tpar_collectives::tcp::TCP_HOST_ENV) names another host. A store
    /// that cannot be reached is a [`CollectiveError::Backend`] error of op `"init"`
    /// whose message holds the [`RendezvousError`]. Rank 0 hosts the store: call
    /// `barrier()` on the world before it exits.
    pub fn tcp_world(
        &self,
        timeout: Duration,
    ) -> std::result::Result<ProcessGroup, CollectiveError> {
        let store = self.store(timeout).map_err(|e| CollectiveError::Backend {
            backend: "tcp",
            op: "init",
            group: (0..self.world_size).collect(),
            rank: self.rank,
            message: format!("rendezvous: {e}"),
        })?;
        ProcessGroup::tcp_world(Arc::new(store), self.rank, self.world_size, timeout)
    }

    /// The world group of this process on `backend`: [`nccl_world`](Self::nccl_world) or
    /// [`tcp_world`](Self::tcp_world).
    pub fn world(
        &self,
        backend: BackendName,
        timeout: Duration,
    ) -> std::result::Result<ProcessGroup, CollectiveError> {
        match backend {
            BackendName::Nccl => self.nccl_world(timeout),
            BackendName::Tcp => self.tcp_world(timeout),
        }
    }
}

/// Environment variable that picks the backend of [`init_process_group`]: `nccl` (the
/// default) or `tcp`.
pub const BACKEND_ENV: &str = "TPAR_BACKEND";

/// A multi-process backend [`init_process_group_with`] can build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendName {
    /// One process per GPU, over NCCL.
    Nccl,
    /// Processes on one host or several, over TCP, with host tensors (gloo's role).
    Tcp,
}

impl BackendName {
    /// `"nccl"` or `"tcp"`.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendName::Nccl => "nccl",
            BackendName::Tcp => "tcp",
        }
    }
}

impl std::fmt::Display for BackendName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BackendName {
    type Err = CollectiveError;

    /// `"nccl"` or `"tcp"` (case and surrounding space ignored); anything else is
    /// [`CollectiveError::InvalidArgument`] listing both.
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "nccl" => Ok(BackendName::Nccl),
            "tcp" => Ok(BackendName::Tcp),
            other => Err(CollectiveError::InvalidArgument {
                op: "init_process_group",
                why: format!("unknown backend {other:?}: expected \"nccl\" or \"tcp\""),
            }),
        }
    }
}

/// Creates the world group from the launch environment of this process
/// ([`EnvInit::from_env`], then [`EnvInit::world`]) on the backend [`BACKEND_ENV`]
/// (`TPAR_BACKEND`) names, `nccl` when it is unset: PyTorch's
/// `init_process_group("nccl")`. A missing or invalid variable is
/// [`CollectiveError::InvalidArgument`] naming it. To choose the backend in code, use
/// [`init_process_group_with`].
///
/// ```no_run
/// use std::time::Duration;
/// use tpar_collectives::ReduceOp;
/// use tpar_tensor::Tensor;
///
/// let world = tpar_launch::init_process_group(Duration::from_secs(300))?;
/// let t = Tensor::from_vec(vec![world.rank() as f32; 4], [4])?;
/// let sum = world.all_reduce(&t, ReduceOp::Sum)?;
/// world.barrier()?; // before rank 0, which hosts the store, exits
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn init_process_group(timeout: Duration) -> std::result::Result<ProcessGroup, CollectiveError> {
    let backend = match std::env::var(BACKEND_ENV) {
        Ok(v) if !v.trim().is_empty() => v.parse().map_err(|e| match e {
            CollectiveError::InvalidArgument { op, why } => {
                CollectiveError::InvalidArgument { op, why: format!("{BACKEND_ENV}: {why}") }
            }
            other => other,
        })?,
        _ => BackendName::Nccl,
    };
    init_process_group_with(backend.as_str(), timeout)
}

/// Creates the world group on `backend` (`"nccl"` or `"tcp"`, see [`BackendName`]) from
/// the launch environment of this process ([`EnvInit::from_env`], then
/// [`EnvInit::world`]): PyTorch's `init_process_group(backend)`, with `"tcp"` in the
/// role of `"gloo"`. An unknown backend name, or a missing or invalid variable, is
/// [`CollectiveError::InvalidArgument`] naming it.
///
/// ```no_run
/// use std::time::Duration;
/// use tpar_collectives::ReduceOp;
/// use tpar_tensor::Tensor;
///
/// // Started by `tpar-run --nproc-per-node 4 -- prog` (or torchrun), with or without GPUs.
/// let world = tpar_launch::init_process_group_with("tcp", Duration::from_secs(60))?;
/// let t = Tensor::from_vec(vec![world.rank() as f32; 4], [4])?;
/// let sum = world.all_reduce(&t, ReduceOp::Sum)?;
/// world.barrier()?; // before rank 0, which hosts the store, exits
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn init_process_group_with(
    backend: &str,
    timeout: Duration,
) -> std::result::Result<ProcessGroup, CollectiveError> {
    let backend: BackendName = backend.parse()?;
    threads_from_env();
    let env = EnvInit::from_env().map_err(|e| CollectiveError::InvalidArgument {
        op: "init_process_group",
        why: e.to_string(),
    })?;
    env.world(backend, timeout)
}

/// Sizes this process's pool of kernel threads (rayon's global pool) from
/// `OMP_NUM_THREADS`, the variable torchrun and `tpar-run` set for each rank (1 when a
/// node runs several ranks, so that they do not oversubscribe its cores), as PyTorch's
/// intra-op threads follow it. Does nothing when `RAYON_NUM_THREADS` is set (rayon reads
/// it), when the variable is not a positive number, or when the pool already runs;
/// returns the thread count it set. [`init_process_group_with`] calls it.
///
/// ```
/// // Without OMP_NUM_THREADS the pool keeps one thread per core.
/// if std::env::var_os("OMP_NUM_THREADS").is_none() {
///     assert_eq!(tpar_launch::threads_from_env(), None);
/// }
/// ```
pub fn threads_from_env() -> Option<usize> {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return None;
    }
    let n =
        std::env::var("OMP_NUM_THREADS").ok()?.trim().parse::<usize>().ok().filter(|&n| n > 0)?;
    rayon::ThreadPoolBuilder::new().num_threads(n).build_global().ok().map(|()| n)
}

/// Refuses to run a job whose ranks are threads of this process when this process was
/// started as one rank of a multi-process job: `RANK` or `WORLD_SIZE` set (unless
/// `WORLD_SIZE=1`), `SLURM_PROCID` with `SLURM_NTASKS` above 1, or `OMPI_COMM_WORLD_SIZE`
/// above 1. Each of the launcher's processes would otherwise run the whole job, a
/// duplicate of every other. The error
/// ([`RendezvousError::LaunchedAsProcesses`]) names the variables and says to pass the
/// process backend. Call it where a program picks its in-process (`local`) backend.
///
/// ```
/// // In a program started without a launcher:
/// tpar_launch::check_not_launched()?;
/// # Ok::<(), tpar_launch::RendezvousError>(())
/// ```
pub fn check_not_launched() -> Result<()> {
    check_not_launched_in(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
}

/// [`check_not_launched`] over any variable source.
pub fn check_not_launched_in(var: impl Fn(&str) -> Option<String>) -> Result<()> {
    let var = |name: &str| var(name).map(|v| v.trim().to_string());
    let pairs = |names: &[&str]| {
        names
            .iter()
            .filter_map(|n| var(n).map(|v| format!("{n}={v}")))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let many = |v: Option<String>| v.and_then(|w| w.parse::<usize>().ok()).is_some_and(|w| w > 1);
    let (rank, world) = (var("RANK"), var("WORLD_SIZE"));
    if (rank.is_some() || world.is_some()) && world.as_deref() != Some("1") {
        return Err(RendezvousError::LaunchedAsProcesses {
            vars: pairs(&["RANK", "WORLD_SIZE", "LOCAL_RANK"]),
            world_size: world.unwrap_or_else(|| "?".into()),
        });
    }
    if var("SLURM_PROCID").is_some() && many(var("SLURM_NTASKS")) {
        return Err(RendezvousError::LaunchedAsProcesses {
            vars: pairs(&["SLURM_PROCID", "SLURM_NTASKS"]),
            world_size: var("SLURM_NTASKS").unwrap_or_default(),
        });
    }
    if many(var("OMPI_COMM_WORLD_SIZE")) {
        return Err(RendezvousError::LaunchedAsProcesses {
            vars: pairs(&["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"]),
            world_size: var("OMPI_COMM_WORLD_SIZE").unwrap_or_default(),
        });
    }
    Ok(())
}

fn invalid(var: &'static str, value: &str, why: String) -> RendezvousError {
    RendezvousError::InvalidEnv { var, value: value.to_string(), why }
}

/// The first host of a Slurm host list: `node[01-04,07],gpu3` gives `node01`,
/// `rack[2-3]-n[5,9]` gives `rack2-n5`. `None` when the list is empty or its brackets
/// do not match.
pub fn first_slurm_host(list: &str) -> Option<String> {
    // The first entry: up to the first comma outside brackets.
    let mut depth = 0i32;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
        if depth < 0 {
            return None;
        }
    }
    let entry = list[..end].trim();
    let mut host = String::new();
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        let close = rest[open..].find(']')? + open;
        host.push_str(&rest[..open]);
        // The first number of the first range, as written (zero padding kept).
        let first = rest[open + 1..close].split([',', '-']).next()?.trim();
        if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return None;
    }
    host.push_str(rest);
    (!host.is_empty()).then_some(host)
}

/// The tasks on node `node` from Slurm's `SLURM_TASKS_PER_NODE` (`2(x3),1`: three
/// nodes of 2, then one of 1).
fn slurm_tasks_on_node(spec: &str, node: usize) -> Option<usize> {
    let mut seen = 0usize;
    for part in spec.split(',') {
        let part = part.trim();
        let (n, times) = match part.split_once("(x") {
            Some((n, t)) => (n, t.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (part, 1),
        };
        let n = n.parse::<usize>().ok()?;
        seen += times;
        if node < seen {
            return Some(n);
        }
    }
    None
}

/// `host:port`, bracketing IPv6 literals.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, TcpListener};
    use std::thread;

    use super::*;

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn env_init_reads_and_validates() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
        };
        let ok = EnvInit::from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!((ok.rank, ok.world_size, ok.local_rank), (3, 4, 1));
        assert_eq!(ok.local_world_size, Some(2));
        assert_eq!(ok.master_endpoint(), "node0:29500");
        let no_lws = EnvInit::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "::1"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap();
        assert_eq!(no_lws.local_world_size, None);
        assert_eq!(no_lws.master_endpoint(), "[::1]:1");

        let err = |pairs| EnvInit::from_vars(vars(pairs)).unwrap_err().to_string();
        let m = err(&[("RANK", "0")]);
        assert!(m.contains("WORLD_SIZE is not set"), "{m}");
        let m = err(&[
            ("RANK", "x"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(m.contains("RANK=\"x\""), "{m}");
        let m = err(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(m.contains("RANK=\"2\"") && m.contains("WORLD_SIZE=2"), "{m}");
        let m = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "70000"),
        ]);
        assert!(m.contains("MASTER_PORT=\"70000\""), "{m}");
        let m =
            err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_PORT", "1")]);
        assert!(m.contains("MASTER_ADDR is not set"), "{m}");
        let m = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(m.contains("LOCAL_RANK=\"2\""), "{m}");
    }

    fn vars_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name: &str| owned.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn slurm_environment() {
        let base = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_TASKS_PER_NODE", "2(x3),1,1"),
            ("SLURM_JOB_NODELIST", "node[01-04,07],gpu3"),
            ("SLURM_JOB_ID", "123456"),
        ];
        let e = EnvInit::from_vars(vars_of(&base)).unwrap();
        assert_eq!(e.source, EnvSource::Slurm);
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (5, 8, 1, Some(2)));
        assert_eq!((e.master_addr.as_str(), e.master_port), ("node01", 29500 + 456));
        assert!(!e.agent_store);
        // MASTER_ADDR and MASTER_PORT win; SLURM_NODELIST is the older name.
        let mut v = base.to_vec();
        v.retain(|(k, _)| *k != "SLURM_JOB_NODELIST" && *k != "SLURM_JOB_ID");
        v.push(("SLURM_NODELIST", "gpu3,node[1-2]"));
        let e = EnvInit::from_vars(vars_of(&v)).unwrap();
        assert_eq!((e.master_addr.as_str(), e.master_port), ("gpu3", 29500));
        v.push(("MASTER_ADDR", "head"));
        v.push(("MASTER_PORT", "1234"));
        let e = EnvInit::from_vars(vars_of(&v)).unwrap();
        assert_eq!((e.master_addr.as_str(), e.master_port), ("head", 1234));
        // RANK/WORLD_SIZE take precedence over Slurm's.
        let mut t = v.clone();
        t.extend([("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")]);
        assert_eq!(EnvInit::from_vars(vars_of(&t)).unwrap().source, EnvSource::Torch);
        // Errors name Slurm's variables.
        let mut bad = base.to_vec();
        bad.retain(|(k, _)| *k != "SLURM_NTASKS");
        let m = EnvInit::from_vars(vars_of(&bad)).unwrap_err().to_string();
        assert!(m.contains("SLURM_NTASKS is not set"), "{m}");
        let mut bad = base.to_vec();
        bad[0] = ("SLURM_PROCID", "8");
        let m = EnvInit::from_vars(vars_of(&bad)).unwrap_err().to_string();
        assert!(m.contains("SLURM_PROCID=\"8\"") && m.contains("SLURM_NTASKS=8"), "{m}");
        let mut no_list = base.to_vec();
        no_list.retain(|(k, _)| *k != "SLURM_JOB_NODELIST");
        let m = EnvInit::from_vars(vars_of(&no_list)).unwrap_err().to_string();
        assert!(m.contains("MASTER_ADDR is not set"), "{m}");
    }

    #[test]
    fn open_mpi_environment() {
        let one_node = [
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ];
        let e = EnvInit::from_vars(vars_of(&one_node)).unwrap();
        assert_eq!(e.source, EnvSource::OpenMpi);
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (2, 4, 2, Some(4)));
        assert_eq!(e.master_endpoint(), "127.0.0.1:29500");
        let mut two_nodes = one_node.to_vec();
        two_nodes[3] = ("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
        two_nodes[2] = ("OMPI_COMM_WORLD_LOCAL_RANK", "0");
        let m = EnvInit::from_vars(vars_of(&two_nodes)).unwrap_err().to_string();
        assert!(m.contains("MASTER_ADDR") && m.contains("span several nodes"), "{m}");
        two_nodes.extend([("MASTER_ADDR", "n0"), ("MASTER_PORT", "777")]);
        let e = EnvInit::from_vars(vars_of(&two_nodes)).unwrap();
        assert_eq!(e.master_endpoint(), "n0:777");
    }

    #[test]
    fn missing_everything_names_every_supported_launcher() {
        let m = EnvInit::from_vars(|_| None).unwrap_err().to_string();
        for want in
            ["RANK is not set", "torchrun", "tpar-run", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"]
        {
            assert!(m.contains(want), "{want} in {m}");
        }
    }

    #[test]
    fn torchrun_agent_variables() {
        let e = EnvInit::from_vars(vars_of(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "3"),
            ("TORCHELASTIC_RUN_ID", "job7"),
        ]))
        .unwrap();
        assert!(e.agent_store);
        assert_eq!((e.restart_count, e.run_id.as_deref()), (3, Some("job7")));
        assert_eq!(e.agent_store_key(), "tpar/job7/3/store");
    }

    #[test]
    fn slurm_host_lists() {
        assert_eq!(first_slurm_host("node[01-04,07],gpu3").as_deref(), Some("node01"));
        assert_eq!(first_slurm_host("gpu3,node[1-2]").as_deref(), Some("gpu3"));
        assert_eq!(first_slurm_host("rack[2-3]-n[5,9]").as_deref(), Some("rack2-n5"));
        assert_eq!(first_slurm_host("n[007]").as_deref(), Some("n007"));
        assert_eq!(first_slurm_host("single").as_deref(), Some("single"));
        assert_eq!(first_slurm_host(""), None);
        assert_eq!(first_slurm_host("n[1-2"), None);
        assert_eq!(first_slurm_host("n1-2]"), None);
        assert_eq!(slurm_tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 4), None);
        assert_eq!(slurm_tasks_on_node("4", 0), Some(4));
    }

    #[test]
    fn launched_jobs_refuse_the_in_process_backend() {
        assert!(check_not_launched_in(|_| None).is_ok());
        assert!(check_not_launched_in(vars_of(&[("RANK", "0"), ("WORLD_SIZE", "1")])).is_ok());
        let e = check_not_launched_in(vars_of(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(matches!(e, RendezvousError::LaunchedAsProcesses { .. }), "{e}");
        let m = e.to_string();
        assert!(m.contains("RANK=0, WORLD_SIZE=2") && m.contains("process backend"), "{m}");
        let m = check_not_launched_in(vars_of(&[("RANK", "1")])).unwrap_err().to_string();
        assert!(m.contains("RANK=1"), "{m}");
        let slurm = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")];
        let m = check_not_launched_in(vars_of(&slurm)).unwrap_err().to_string();
        assert!(m.contains("SLURM_NTASKS=4") && m.contains("one of 4 processes"), "{m}");
        assert!(
            check_not_launched_in(vars_of(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")])).is_ok()
        );
        let m = check_not_launched_in(vars_of(&[("OMPI_COMM_WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(m.contains("OMPI_COMM_WORLD_SIZE=2"), "{m}");
    }

    #[test]
    fn backend_names_parse() {
        assert_eq!("tcp".parse::<BackendName>().unwrap(), BackendName::Tcp);
        assert_eq!(" NCCL ".parse::<BackendName>().unwrap(), BackendName::Nccl);
        assert_eq!(BackendName::Tcp.to_string(), "tcp");
        let e = "gloo".parse::<BackendName>().unwrap_err();
        assert!(
            matches!(&e, CollectiveError::InvalidArgument { why, .. }
            if why.contains("\"gloo\"") && why.contains("\"tcp\"")),
            "{e}"
        );
        let e = init_process_group_with("mpi", T).unwrap_err();
        assert!(e.to_string().contains("unknown backend"), "{e}");
        if std::env::var_os("RANK").is_none() {
            let e = init_process_group_with("tcp", T).unwrap_err();
            assert!(e.to_string().contains("RANK"), "{e}");
        }
    }

    #[test]
    fn env_init_store_rank0_hosts() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let env = move |rank: usize| EnvInit {
            rank,
            world_size: 2,
            local_rank: rank,
            local_world_size: Some(2),
            master_addr: "127.0.0.1".into(),
            master_port: port,
            source: EnvSource::Torch,
            agent_store: false,
            restart_count: 0,
            run_id: None,
        };
        let h = thread::spawn(move || {
            let c = env(1).store(T).unwrap();
            assert!(!c.is_server());
            let v = c.get("nccl_id/world").unwrap();
            c.barrier("done").unwrap();
            v
        });
        let s = env(0).store(T).unwrap();
        assert!(s.is_server());
        assert_eq!(s.local_addr().unwrap().ip(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        s.set("nccl_id/world", &[9; 128]).unwrap();
        s.barrier("done").unwrap();
        assert_eq!(h.join().unwrap(), vec![9; 128]);
    }
}
