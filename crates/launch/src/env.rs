//! The launch environment: who this process is and where the rendezvous store lives,
//! from the variables torchrun, `srun` wrappers and `tpar-run` set; and the world built
//! from it (PyTorch's `init_process_group("nccl")` or `init_process_group("gloo")`),
//! on the `nccl` or the `tcp` backend.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use tpar_collectives::{nccl, CollectiveError, ProcessGroup};

use crate::rendezvous::{RendezvousError, Result, TcpStore};

/// The launch environment torchrun, `srun` wrappers and `tpar-run` give each
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
}

impl EnvInit {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`
    /// (optional), `MASTER_ADDR` and `MASTER_PORT` from the process
    /// environment; a missing or invalid variable is an error naming it.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// [`from_env`](Self::from_env) over any variable source (tests, config files).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |name: &'static str| {
            var(name).map(|v| v.trim().to_string()).ok_or(RendezvousError::MissingEnv { var: name })
        };
        let invalid = |var: &'static str, value: &str, why: String| RendezvousError::InvalidEnv {
            var,
            value: value.to_string(),
            why,
        };
        let number = |name: &'static str, value: String| {
            value
                .parse::<usize>()
                .map_err(|e| invalid(name, &value, format!("not a non-negative integer ({e})")))
        };
        let rank = number("RANK", get("RANK")?)?;
        let world_size = number("WORLD_SIZE", get("WORLD_SIZE")?)?;
        let local_rank = number("LOCAL_RANK", get("LOCAL_RANK")?)?;
        let local_world_size = match var("LOCAL_WORLD_SIZE") {
            None => None,
            Some(v) => Some(number("LOCAL_WORLD_SIZE", v.trim().to_string())?),
        };
        let master_addr = get("MASTER_ADDR")?;
        let port_text = get("MASTER_PORT")?;
        let master_port = port_text
            .parse::<u16>()
            .map_err(|e| invalid("MASTER_PORT", &port_text, format!("not a port number ({e})")))?;

        if world_size == 0 {
            return Err(invalid("WORLD_SIZE", "0", "must be at least 1".into()));
        }
        if rank >= world_size {
            return Err(invalid(
                "RANK",
                &rank.to_string(),
                format!("must be below WORLD_SIZE={world_size}"),
            ));
        }
        if let Some(lws) = local_world_size {
            if lws == 0 || lws > world_size {
                return Err(invalid(
                    "LOCAL_WORLD_SIZE",
                    &lws.to_string(),
                    format!("must be between 1 and WORLD_SIZE={world_size}"),
                ));
            }
            if local_rank >= lws {
                return Err(invalid(
                    "LOCAL_RANK",
                    &local_rank.to_string(),
                    format!("must be below LOCAL_WORLD_SIZE={lws}"),
                ));
            }
        } else if local_rank >= world_size {
            return Err(invalid(
                "LOCAL_RANK",
                &local_rank.to_string(),
                format!("must be below WORLD_SIZE={world_size}"),
            ));
        }
        if master_addr.is_empty() {
            return Err(invalid("MASTER_ADDR", "", "is empty".into()));
        }
        if master_port == 0 {
            return Err(invalid("MASTER_PORT", "0", "must be between 1 and 65535".into()));
        }
        Ok(Self { rank, world_size, local_rank, local_world_size, master_addr, master_port })
    }

    /// `MASTER_ADDR:MASTER_PORT`, with IPv6 literals bracketed.
    pub fn master_endpoint(&self) -> String {
        host_port(&self.master_addr, self.master_port)
    }

    /// Connects to the job's store: rank 0 starts the server and the others
    /// connect to it (retrying until `timeout`, since rank 0 may start
    /// later). `timeout` becomes the store's default timeout.
    ///
    /// Rank 0 binds `MASTER_ADDR` itself when it names a loopback address,
    /// and every interface (at `MASTER_PORT`) otherwise, so that a host name
    /// that resolves to a loopback alias on the master (a common
    /// `/etc/hosts` entry) still reaches it from other nodes.
    pub fn store(&self, timeout: Duration) -> Result<TcpStore> {
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
    let env = EnvInit::from_env().map_err(|e| CollectiveError::InvalidArgument {
        op: "init_process_group",
        why: e.to_string(),
    })?;
    env.world(backend, timeout)
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
