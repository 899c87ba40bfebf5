//! The store's client, [`TcpStore`]: one connection, requests one at a time.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::ToSocketAddrs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use super::server::Server;
use super::wire::*;
use super::{RendezvousError, Result};

/// A connection to a rendezvous store, and on the hosting rank the server too.
///
/// All operations take `&self` and may be called from several threads; they
/// run one at a time over the store's single connection (a blocking `get`
/// holds it until it returns). Dropping the hosting rank's store stops the
/// server: clients still waiting get [`RendezvousError::ServerGone`]. Call
/// [`TcpStore::barrier`] before the hosting rank drops it.
pub struct TcpStore {
    addr: String,
    conn: Mutex<Option<TcpStream>>,
    timeout: Duration,
    world_size: u64,
    barrier_rounds: Mutex<HashMap<String, u64>>,
    local_addr: Option<SocketAddr>,
    conn_local_addr: Option<SocketAddr>,
    // Declared last: dropped after the connection above.
    server: Option<Server>,
}

impl fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("hosts_server", &self.server.is_some())
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl TcpStore {
    /// Starts a store server on `addr` (`"host:port"`; port 0 picks a free
    /// one, see [`TcpStore::local_addr`]) for `world_size` ranks, serving on
    /// background threads, and returns a client connected to it.
    /// `timeout` is the default for [`get`](Self::get) and
    /// [`barrier`](Self::barrier) and bounds every other request.
    pub fn server(addr: &str, world_size: usize, timeout: Duration) -> Result<Self> {
        if world_size == 0 {
            return Err(RendezvousError::Invalid { what: "world_size must be at least 1".into() });
        }
        let bind_err = |source| RendezvousError::Bind { addr: addr.to_string(), source };
        let listener = TcpListener::bind(addr).map_err(bind_err)?;
        let local = listener.local_addr().map_err(bind_err)?;
        let server = Server::start(listener, world_size as u64).map_err(bind_err)?;
        // Connect to ourselves through loopback when bound to every interface.
        let connect_to = match local.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => {
                SocketAddr::new(Ipv4Addr::LOCALHOST.into(), local.port())
            }
            IpAddr::V6(ip) if ip.is_unspecified() => {
                SocketAddr::new(Ipv6Addr::LOCALHOST.into(), local.port())
            }
            _ => local,
        };
        let mut store = Self::client(&connect_to.to_string(), timeout)?;
        store.server = Some(server);
        store.local_addr = Some(local);
        Ok(store)
    }

    /// Connects to the store at `addr` (`"host:port"`), retrying refused or
    /// failed connections (the server may start later) until `timeout`
    /// passes. `timeout` is also the default for [`get`](Self::get) and
    /// [`barrier`](Self::barrier) and bounds every other request.
    pub fn client(addr: &str, timeout: Duration) -> Result<Self> {
        let started = Instant::now();
        let deadline = started.checked_add(timeout);
        let left = || match deadline {
            None => Some(Duration::from_secs(3600)),
            Some(d) => d.checked_duration_since(Instant::now()).filter(|l| !l.is_zero()),
        };
        let mut attempts = 0u32;
        let mut backoff = Duration::from_millis(10);
        let stream = loop {
            attempts += 1;
            let err = match connect_once(addr, left().unwrap_or(Duration::from_millis(1))) {
                Ok(s) => break s,
                Err(e) => e,
            };
            match left() {
                Some(l) => thread::sleep(backoff.min(l)),
                None => {
                    return Err(RendezvousError::Connect {
                        addr: addr.to_string(),
                        timeout,
                        attempts,
                        source: err,
                    })
                }
            }
            backoff = (backoff * 2).min(Duration::from_millis(500));
        };
        let _ = stream.set_nodelay(true);
        let conn_local_addr = stream.local_addr().ok();
        let mut store = Self {
            addr: addr.to_string(),
            conn: Mutex::new(Some(stream)),
            timeout,
            world_size: 0,
            barrier_rounds: Mutex::new(HashMap::new()),
            local_addr: None,
            conn_local_addr,
            server: None,
        };
        let handshake = Enc::default().u8(OP_HELLO).bytes(MAGIC).u32(VERSION);
        // Bound the handshake even when the connection used up the timeout.
        let handshake_timeout = left().unwrap_or_default().max(Duration::from_secs(1));
        let mut d_reply = store.request("connect", &[], handshake, Some(handshake_timeout))?;
        let world = store.decode(&mut d_reply, |d| {
            let w = d.u64()?;
            d.end()?;
            Ok(w)
        })?;
        store.world_size = world;
        Ok(store)
    }

    /// The address the server listens on, when this store hosts it (useful
    /// after binding port 0); `None` for a client.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local_addr
    }

    /// This process's end of its connection to the store: the local interface that
    /// reaches the store's host (loopback on the hosting rank).
    pub fn connection_local_addr(&self) -> Option<SocketAddr> {
        self.conn_local_addr
    }

    /// The address this store was connected to.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The world size the server was started with.
    pub fn world_size(&self) -> usize {
        self.world_size as usize
    }

    /// The default timeout of [`get`](Self::get) and [`barrier`](Self::barrier).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Changes the default timeout.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Whether this store hosts the server.
    pub fn is_server(&self) -> bool {
        self.server.is_some()
    }

    /// Registers this connection as `rank` of a job of `world_size` ranks, before the
    /// job's first wait in the store ([`EnvInit::store`](crate::EnvInit::store) does it).
    ///
    /// The store checks that `world_size` is its host's and that no other live
    /// connection holds `rank`; if not, this fails with
    /// [`RendezvousError::JobMismatch`] naming both world sizes (or the rank claimed
    /// twice), and so does every other rank's next wait in the store. From then on, if
    /// this connection closes without the goodbye that dropping the store sends (the
    /// process died), every rank waiting in the store gets [`RendezvousError::RankGone`]
    /// naming `rank` at once. Joining again as the same rank is allowed.
    pub fn join(&self, rank: usize, world_size: usize) -> Result<()> {
        let req = Enc::default().u8(OP_JOIN).u64(rank as u64).u64(world_size as u64);
        let mut reply = self.request("join", &[], req, Some(self.timeout))?;
        self.decode(&mut reply, |d| d.end())
    }

    /// Stores `value` under `key`, replacing any previous value and waking
    /// every `get`/`wait` on it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let req = Enc::default().u8(OP_SET).bytes(key.as_bytes()).bytes(value);
        let mut reply = self.request("set", &[key], req, Some(self.timeout))?;
        self.decode(&mut reply, |d| d.end())
    }

    /// The value of `key`, waiting up to the store's timeout for it to be set.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let req = Enc::default().u8(OP_GET).bytes(key.as_bytes()).millis(timeout);
        match self.request("get", &[key], req, timeout.checked_add(REPLY_GRACE)) {
            Err(RendezvousError::Timeout { addr, op, keys, .. }) => {
                Err(RendezvousError::Timeout { addr, op, keys, timeout })
            }
            Err(e) => Err(e),
            Ok(mut reply) => self.decode(&mut reply, |d| {
                let v = d.bytes()?.to_vec();
                d.end()?;
                Ok(v)
            }),
        }
    }

    /// Waits up to `timeout` until every key in `keys` is set.
    pub fn wait<S: AsRef<str>>(&self, keys: &[S], timeout: Duration) -> Result<()> {
        let names: Vec<&str> = keys.iter().map(|k| k.as_ref()).collect();
        let req = Enc::default().u8(OP_WAIT).keys(keys).millis(timeout);
        match self.request("wait", &names, req, timeout.checked_add(REPLY_GRACE)) {
            Err(RendezvousError::Timeout { addr, op, keys, .. }) => {
                Err(RendezvousError::Timeout { addr, op, keys, timeout })
            }
            Err(e) => Err(e),
            Ok(mut reply) => self.decode(&mut reply, |d| d.end()),
        }
    }

    /// Adds `delta` to the integer counter under `key` (absent counts as 0)
    /// atomically and returns the new value. Counters are stored as decimal
    /// text, as in PyTorch, so [`get`](Self::get) reads them as e.g. `b"3"`.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let req = Enc::default().u8(OP_ADD).bytes(key.as_bytes()).i64(delta);
        let mut reply = self.request("add", &[key], req, Some(self.timeout))?;
        self.decode(&mut reply, |d| {
            let v = d.i64()?;
            d.end()?;
            Ok(v)
        })
    }

    /// Whether every key in `keys` is set, without waiting.
    pub fn check<S: AsRef<str>>(&self, keys: &[S]) -> Result<bool> {
        let names: Vec<&str> = keys.iter().map(|k| k.as_ref()).collect();
        let req = Enc::default().u8(OP_CHECK).keys(keys);
        let mut reply = self.request("check", &names, req, Some(self.timeout))?;
        self.decode(&mut reply, |d| {
            let v = d.u8()?;
            d.end()?;
            Ok(v != 0)
        })
    }

    /// Removes `key`; returns whether it was set.
    pub fn delete_key(&self, key: &str) -> Result<bool> {
        let req = Enc::default().u8(OP_DELETE).bytes(key.as_bytes());
        let mut reply = self.request("delete", &[key], req, Some(self.timeout))?;
        self.decode(&mut reply, |d| {
            let v = d.u8()?;
            d.end()?;
            Ok(v != 0)
        })
    }

    /// Blocks until all `world_size` ranks have called `barrier` with the
    /// same `name` the same number of times, or the store's timeout passes
    /// (the error says how many arrived). Names can be reused: each call
    /// joins the next round of that name.
    ///
    /// It is a counter (`add`) and a wait on it, done as one request so
    /// that the hosting rank may drop its store as soon as its own barrier
    /// returns: every other rank's answer is already being sent.
    pub fn barrier(&self, name: &str) -> Result<()> {
        self.barrier_timeout(name, self.timeout)
    }

    /// [`barrier`](Self::barrier) with an explicit timeout.
    pub fn barrier_timeout(&self, name: &str, timeout: Duration) -> Result<()> {
        let round = {
            let mut rounds = self.barrier_rounds.lock().unwrap_or_else(|p| p.into_inner());
            let r = rounds.entry(name.to_string()).or_insert(0);
            *r += 1;
            *r
        };
        let key = format!("__tpar/barrier/{name}/{round}");
        let req = Enc::default()
            .u8(OP_BARRIER)
            .bytes(key.as_bytes())
            .u64(self.world_size)
            .millis(timeout);
        let mut reply = self.request("barrier", &[&key], req, timeout.checked_add(REPLY_GRACE))?;
        match reply.status {
            ST_TIMEOUT => {
                let arrived = self.decode(&mut reply, |d| d.u64())?;
                Err(RendezvousError::BarrierTimeout {
                    addr: self.addr.clone(),
                    name: name.to_string(),
                    arrived,
                    world_size: self.world_size,
                    timeout,
                })
            }
            _ => self.decode(&mut reply, |d| d.end()),
        }
    }

    /// Sends one request and reads its reply. Timeouts answered by the
    /// server are returned as `Reply { status: ST_TIMEOUT }` only for the
    /// barrier; other ops turn them into [`RendezvousError::Timeout`] here.
    fn request(
        &self,
        op: &'static str,
        keys: &[&str],
        req: Enc,
        read_timeout: Option<Duration>,
    ) -> Result<Reply> {
        let keys_owned = || keys.iter().map(|k| k.to_string()).collect::<Vec<_>>();
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let Some(stream) = guard.as_mut() else {
            return Err(RendezvousError::Closed { addr: self.addr.clone() });
        };
        let rt = read_timeout.map(|t| t.max(Duration::from_millis(1)));
        let io_err = |source: io::Error| match source.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => RendezvousError::Timeout {
                addr: self.addr.clone(),
                op,
                keys: keys_owned(),
                timeout: read_timeout.unwrap_or(Duration::MAX),
            },
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => {
                RendezvousError::ServerGone { addr: self.addr.clone(), op, keys: keys_owned() }
            }
            _ => RendezvousError::Io { addr: self.addr.clone(), op, keys: keys_owned(), source },
        };
        let result = (|| {
            stream.set_read_timeout(rt).map_err(io_err)?;
            stream
                .set_write_timeout(Some(self.timeout.max(Duration::from_millis(1))))
                .map_err(io_err)?;
            write_frame(stream, &req.0).map_err(io_err)?;
            let body = match read_frame(stream) {
                Ok(b) => b,
                Err(FrameError::Eof) => return Err(io_err(io::ErrorKind::UnexpectedEof.into())),
                Err(FrameError::Io(e)) => return Err(io_err(e)),
                Err(FrameError::Malformed(what)) => {
                    return Err(RendezvousError::Protocol { addr: self.addr.clone(), what })
                }
            };
            let Some((&status, payload)) = body.split_first() else {
                return Err(RendezvousError::Protocol {
                    addr: self.addr.clone(),
                    what: format!("empty reply to {op}"),
                });
            };
            Ok(Reply { status, payload: payload.to_vec(), op, keys: keys_owned() })
        })();
        match result {
            Ok(reply) if reply.status == ST_OK => Ok(reply),
            Ok(reply) if reply.status == ST_TIMEOUT && op == "barrier" => Ok(reply),
            Ok(reply) if reply.status == ST_TIMEOUT => {
                let mut d = Dec(&reply.payload);
                let missing = if op == "wait" { d.keys().ok() } else { None };
                Err(RendezvousError::Timeout {
                    addr: self.addr.clone(),
                    op,
                    keys: missing.unwrap_or_else(keys_owned),
                    timeout: Duration::ZERO, // replaced by the caller
                })
            }
            Ok(reply) if reply.status == ST_FAILED => {
                let mut d = Dec(&reply.payload);
                let (kind, rank, message) = match (d.u8(), d.u64(), d.bytes()) {
                    (Ok(k), Ok(r), Ok(m)) => (k, r, String::from_utf8_lossy(m).into_owned()),
                    _ => {
                        return Err(RendezvousError::Protocol {
                            addr: self.addr.clone(),
                            what: format!("malformed failure reply to {op}"),
                        })
                    }
                };
                let rank = usize::try_from(rank).unwrap_or(usize::MAX);
                let addr = self.addr.clone();
                Err(match kind {
                    FAIL_GONE => {
                        RendezvousError::RankGone { addr, rank, op, keys: keys_owned(), message }
                    }
                    _ => RendezvousError::JobMismatch { addr, rank, message },
                })
            }
            Ok(reply) if reply.status == ST_REFUSED || reply.status == ST_ERROR => {
                let message = String::from_utf8_lossy(Dec(&reply.payload).bytes().unwrap_or(b""))
                    .into_owned();
                if reply.status == ST_REFUSED {
                    Err(RendezvousError::Server {
                        addr: self.addr.clone(),
                        op,
                        keys: keys_owned(),
                        message,
                    })
                } else {
                    // The server closes the connection after a malformed request.
                    *guard = None;
                    Err(RendezvousError::Protocol { addr: self.addr.clone(), what: message })
                }
            }
            Ok(reply) => {
                *guard = None;
                Err(RendezvousError::Protocol {
                    addr: self.addr.clone(),
                    what: format!("unknown reply status {} to {op}", reply.status),
                })
            }
            Err(e) => {
                // The stream may be out of step with the server now: stop using it.
                if let Some(s) = guard.take() {
                    let _ = s.shutdown(Shutdown::Both);
                }
                Err(e)
            }
        }
    }

    fn decode<T>(
        &self,
        reply: &mut Reply,
        f: impl FnOnce(&mut Dec<'_>) -> Result<T, String>,
    ) -> Result<T> {
        f(&mut Dec(&reply.payload)).map_err(|what| RendezvousError::Protocol {
            addr: self.addr.clone(),
            what: format!("reply to {} of {:?}: {what}", reply.op, reply.keys),
        })
    }
}

impl Drop for TcpStore {
    fn drop(&mut self) {
        // Close our own connection first so the server's drain does not wait on it, saying
        // goodbye: the server tells a dropped store from a dead process by it.
        if let Some(mut s) = self.conn.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = write_frame(&mut s, &Enc::default().u8(OP_BYE).0);
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

struct Reply {
    status: u8,
    payload: Vec<u8>,
    op: &'static str,
    keys: Vec<String>,
}

/// One connection attempt to every address `addr` resolves to.
fn connect_once(addr: &str, timeout: Duration) -> io::Result<TcpStream> {
    let mut last =
        io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolves to no address"));
    for a in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, timeout.max(Duration::from_millis(1))) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Connects to `addr`, retrying refused or failed connections (the server may start
/// later) with a growing pause until `timeout` passes.
pub(super) fn connect_retrying(addr: &str, timeout: Duration) -> Result<TcpStream> {
    let deadline = Instant::now().checked_add(timeout);
    let left = || match deadline {
        None => Some(Duration::from_secs(3600)),
        Some(d) => d.checked_duration_since(Instant::now()).filter(|l| !l.is_zero()),
    };
    let mut attempts = 0u32;
    let mut backoff = Duration::from_millis(10);
    loop {
        attempts += 1;
        let err = match connect_once(addr, left().unwrap_or(Duration::from_millis(1))) {
            Ok(s) => return Ok(s),
            Err(e) => e,
        };
        match left() {
            Some(l) => thread::sleep(backoff.min(l)),
            None => {
                return Err(RendezvousError::Connect {
                    addr: addr.to_string(),
                    timeout,
                    attempts,
                    source: err,
                })
            }
        }
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}
