//! Multi-process rendezvous: a small TCP key-value store in the manner of
//! PyTorch's `TCPStore`, and the torchrun environment (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) that says where it lives.
//!
//! Rank 0 hosts the server on `MASTER_ADDR:MASTER_PORT`; every rank (rank 0
//! included) talks to it as a client. Backends use it to exchange what they
//! must agree on before the first collective, e.g. the NCCL unique id:
//!
//! ```no_run
//! use std::time::Duration;
//! use tpar_collectives::rendezvous::EnvInit;
//!
//! let env = EnvInit::from_env()?;
//! let store = env.store(Duration::from_secs(300))?;
//! if env.rank == 0 {
//!     store.set("nccl_id/world", &[7u8; 128])?;
//! }
//! let id = store.get("nccl_id/world")?; // blocks until rank 0 has set it
//! assert_eq!(id.len(), 128);
//! store.barrier("exit")?; // keep rank 0's server alive until everyone is done
//! # Ok::<(), tpar_collectives::rendezvous::RendezvousError>(())
//! ```
//!
//! Every operation is bounded by a timeout and every failure (refused
//! connection, timeout, server gone, malformed message) is a
//! [`RendezvousError`] naming the address and the keys involved.
//!
//! The wire protocol is private to this module: each message is a big-endian
//! `u32` length followed by that many bytes (an op code and its
//! length-prefixed fields; replies start with a status byte).

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::ToSocketAddrs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Errors of the rendezvous store and of reading the launch environment.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// The server could not listen on its address.
    #[error("rendezvous store: cannot listen on {addr}: {source}")]
    Bind {
        /// The address the server tried to bind.
        addr: String,
        /// The operating system's error.
        source: io::Error,
    },
    /// No connection to the server within the timeout (it never started, or
    /// the address is wrong or unreachable).
    #[error(
        "rendezvous store at {addr}: no connection within {timeout:?} ({attempts} attempts); \
         last error: {source}"
    )]
    Connect {
        /// The server address.
        addr: String,
        /// How long the client kept retrying.
        timeout: Duration,
        /// How many connection attempts were made.
        attempts: u32,
        /// The last attempt's error.
        source: io::Error,
    },
    /// Keys did not appear (or the server did not answer) within the timeout.
    #[error(
        "rendezvous store at {addr}: {op} timed out after {timeout:?} waiting for key(s) {keys:?}"
    )]
    Timeout {
        /// The server address.
        addr: String,
        /// The operation (`get`, `wait`, `set`, ...).
        op: &'static str,
        /// The keys still missing (or the keys of the request that got no answer).
        keys: Vec<String>,
        /// The timeout that passed.
        timeout: Duration,
    },
    /// A barrier did not fill up within the timeout.
    #[error(
        "rendezvous store at {addr}: barrier {name:?} timed out after {timeout:?}: \
         {arrived} of {world_size} ranks arrived"
    )]
    BarrierTimeout {
        /// The server address.
        addr: String,
        /// The barrier's name.
        name: String,
        /// How many ranks had arrived when the timeout passed.
        arrived: u64,
        /// How many ranks the barrier waits for.
        world_size: u64,
        /// The timeout that passed.
        timeout: Duration,
    },
    /// The server closed the connection (its process ended or dropped the store).
    #[error(
        "rendezvous store at {addr}: server closed the connection during {op} of key(s) {keys:?}"
    )]
    ServerGone {
        /// The server address.
        addr: String,
        /// The operation in flight.
        op: &'static str,
        /// The keys of that operation.
        keys: Vec<String>,
    },
    /// Another I/O error on the connection.
    #[error("rendezvous store at {addr}: i/o error during {op} of key(s) {keys:?}: {source}")]
    Io {
        /// The server address.
        addr: String,
        /// The operation in flight.
        op: &'static str,
        /// The keys of that operation.
        keys: Vec<String>,
        /// The operating system's error.
        source: io::Error,
    },
    /// A message that does not follow the protocol (wrong peer, wrong
    /// version, corrupted bytes).
    #[error("rendezvous store at {addr}: malformed message: {what}")]
    Protocol {
        /// The server address.
        addr: String,
        /// What was wrong.
        what: String,
    },
    /// The server refused a request (e.g. `add` on a key that holds no integer).
    #[error("rendezvous store at {addr}: {op} of key(s) {keys:?} failed on the server: {message}")]
    Server {
        /// The server address.
        addr: String,
        /// The operation.
        op: &'static str,
        /// The keys of that operation.
        keys: Vec<String>,
        /// The server's explanation.
        message: String,
    },
    /// The connection failed earlier and the store can no longer be used.
    #[error("rendezvous store at {addr}: connection is closed after an earlier error")]
    Closed {
        /// The server address.
        addr: String,
    },
    /// An argument out of range (e.g. a world size of 0).
    #[error("rendezvous store: invalid argument: {what}")]
    Invalid {
        /// What was wrong.
        what: String,
    },
    /// A launch environment variable is not set.
    #[error(
        "environment variable {var} is not set (launch with torchrun, srun or tpar-run, \
         or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)"
    )]
    MissingEnv {
        /// The variable's name.
        var: &'static str,
    },
    /// A launch environment variable holds an unusable value.
    #[error("environment variable {var}={value:?} is invalid: {why}")]
    InvalidEnv {
        /// The variable's name.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why it cannot be used.
        why: String,
    },
}

/// Result alias of this module.
pub type Result<T, E = RendezvousError> = std::result::Result<T, E>;

// ---------------------------------------------------------------------------
// Wire format
// ---------------------------------------------------------------------------

const MAGIC: &[u8] = b"tpar-store";
const VERSION: u32 = 1;
/// Largest message either side accepts (keys and values are small: ids, counters).
const MAX_FRAME: usize = 64 << 20;
/// Extra time a client waits for the server's own "timed out" answer.
const REPLY_GRACE: Duration = Duration::from_secs(5);
/// How long a dropped server waits for its connection threads to finish replies.
const DRAIN: Duration = Duration::from_secs(2);

const OP_HELLO: u8 = 0;
const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const OP_WAIT: u8 = 5;
const OP_BARRIER: u8 = 6;
const OP_DELETE: u8 = 7;

const ST_OK: u8 = 0;
const ST_TIMEOUT: u8 = 1;
/// A malformed request; the server closes the connection after it.
const ST_ERROR: u8 = 2;
/// A well-formed request the server refuses; the connection stays usable.
const ST_REFUSED: u8 = 3;

/// Builds one message body.
#[derive(Default)]
struct Enc(Vec<u8>);

impl Enc {
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn bytes(self, v: &[u8]) -> Self {
        let mut s = self.u32(v.len() as u32);
        s.0.extend_from_slice(v);
        s
    }
    fn keys<S: AsRef<str>>(self, keys: &[S]) -> Self {
        keys.iter().fold(self.u32(keys.len() as u32), |e, k| e.bytes(k.as_ref().as_bytes()))
    }
    fn millis(self, d: Duration) -> Self {
        self.u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// Reads one message body; every read is bounds-checked.
struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "message ends early: wanted {n} more bytes, {} left",
                self.0.len()
            ));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn i64(&mut self) -> Result<i64, String> {
        Ok(i64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn string(&mut self) -> Result<String, String> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("key is not UTF-8: {b:?}"))
    }
    fn keys(&mut self) -> Result<Vec<String>, String> {
        let n = self.u32()? as usize;
        // Each key needs at least its 4-byte length: refuse counts the body cannot hold.
        if n > self.0.len() / 4 {
            return Err(format!("key count {n} exceeds the message size"));
        }
        (0..n).map(|_| self.string()).collect()
    }
    fn millis(&mut self) -> Result<Duration, String> {
        Ok(Duration::from_millis(self.u64()?))
    }
    fn end(&self) -> Result<(), String> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(format!("{} unexpected trailing bytes", self.0.len()))
        }
    }
}

enum FrameError {
    /// The peer closed the connection cleanly between messages.
    Eof,
    Io(io::Error),
    Malformed(String),
}

fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)?;
    w.flush()
}

fn read_frame(r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Eof),
            Ok(0) => return Err(FrameError::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::Malformed(format!(
            "message of {len} bytes exceeds the limit of {MAX_FRAME}"
        )));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(FrameError::Io)?;
    Ok(body)
}

// ---------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------

#[derive(Default)]
struct State {
    data: HashMap<String, Vec<u8>>,
    shutdown: bool,
    /// Connection threads still running.
    live: usize,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a key changes, on shutdown, and when a connection thread ends.
    changed: Condvar,
    /// Clones of the accepted sockets, so shutdown can wake blocked reads.
    conns: Mutex<Vec<TcpStream>>,
    world_size: u64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A connection thread never panics while holding the lock; recover anyway.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until `ready` holds, the deadline passes (false) or the server
    /// shuts down (None). `ready` is checked first, so requests satisfied at
    /// shutdown time still get their answer.
    fn wait_until(
        &self,
        timeout: Duration,
        mut ready: impl FnMut(&State) -> bool,
    ) -> Option<(bool, MutexGuard<'_, State>)> {
        let deadline = Instant::now().checked_add(timeout);
        let mut st = self.lock();
        loop {
            if ready(&st) {
                return Some((true, st));
            }
            if st.shutdown {
                return None;
            }
            let wait = match deadline {
                None => Duration::from_secs(3600),
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left,
                    _ => return Some((false, st)),
                },
            };
            st = self.changed.wait_timeout(st, wait).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// The listening half of a store, owned by the rank that hosts it.
struct Server {
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl Server {
    fn start(listener: TcpListener, world_size: u64) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            conns: Mutex::new(Vec::new()),
            world_size,
        });
        let stop = Arc::new(AtomicBool::new(false));
        let accept = {
            let (shared, stop) = (shared.clone(), stop.clone());
            thread::Builder::new()
                .name("tpar-store-accept".into())
                .spawn(move || accept_loop(listener, shared, stop))?
        };
        Ok(Self { shared, stop, accept: Some(accept) })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        {
            let mut st = self.shared.lock();
            st.shutdown = true;
        }
        self.shared.changed.notify_all();
        // Wake connection threads blocked in a read; replies already being
        // written still go out, then each thread closes its socket.
        for c in self.shared.conns.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            let _ = c.shutdown(Shutdown::Read);
        }
        let deadline = Instant::now() + DRAIN;
        let mut st = self.shared.lock();
        while st.live > 0 {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else { break };
            st = self.shared.changed.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let Ok(clone) = stream.try_clone() else { continue };
                if stream.set_nonblocking(false).is_err() {
                    continue;
                }
                let _ = stream.set_nodelay(true);
                shared.lock().live += 1;
                let s = shared.clone();
                let spawned = thread::Builder::new()
                    .name("tpar-store-conn".into())
                    .spawn(move || serve_connection(stream, s));
                match spawned {
                    Ok(_) => shared.conns.lock().unwrap_or_else(|p| p.into_inner()).push(clone),
                    Err(_) => shared.lock().live -= 1,
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(5))
            }
            Err(_) => thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// One client connection: read a request, answer it, until the peer leaves.
fn serve_connection(mut stream: TcpStream, shared: Arc<Shared>) {
    loop {
        let body = match read_frame(&mut stream) {
            Ok(b) => b,
            Err(FrameError::Malformed(what)) => {
                let _ =
                    write_frame(&mut stream, &Enc::default().u8(ST_ERROR).bytes(what.as_bytes()).0);
                break;
            }
            Err(_) => break,
        };
        match handle(&shared, &body) {
            Ok(Some(reply)) => {
                if write_frame(&mut stream, &reply).is_err() {
                    break;
                }
            }
            // Shutting down: close without an answer, the client sees the server gone.
            Ok(None) => break,
            Err(what) => {
                let _ =
                    write_frame(&mut stream, &Enc::default().u8(ST_ERROR).bytes(what.as_bytes()).0);
                break;
            }
        }
    }
    drop(stream);
    shared.lock().live -= 1;
    shared.changed.notify_all();
}

/// Answers one request; `Err` is a malformed request, `Ok(None)` means shutdown.
fn handle(shared: &Shared, body: &[u8]) -> Result<Option<Vec<u8>>, String> {
    let mut d = Dec(body);
    let ok = || Enc::default().u8(ST_OK);
    let reply = match d.u8()? {
        OP_HELLO => {
            let magic = d.bytes()?;
            let version = d.u32()?;
            d.end()?;
            if magic != MAGIC || version != VERSION {
                return Err(format!(
                    "handshake mismatch: peer speaks {:?} v{version}, this server {:?} v{VERSION}",
                    String::from_utf8_lossy(magic),
                    String::from_utf8_lossy(MAGIC)
                ));
            }
            ok().u64(shared.world_size)
        }
        OP_SET => {
            let key = d.string()?;
            let value = d.bytes()?.to_vec();
            d.end()?;
            shared.lock().data.insert(key, value);
            shared.changed.notify_all();
            ok()
        }
        OP_GET => {
            let key = d.string()?;
            let timeout = d.millis()?;
            d.end()?;
            match shared.wait_until(timeout, |st| st.data.contains_key(&key)) {
                None => return Ok(None),
                Some((true, st)) => ok().bytes(&st.data[&key]),
                Some((false, _)) => Enc::default().u8(ST_TIMEOUT),
            }
        }
        OP_ADD => {
            let key = d.string()?;
            let delta = d.i64()?;
            d.end()?;
            let mut st = shared.lock();
            let refuse =
                |msg: String| Ok(Some(Enc::default().u8(ST_REFUSED).bytes(msg.as_bytes()).0));
            let old = match st.data.get(&key) {
                None => 0,
                Some(v) => match std::str::from_utf8(v).ok().and_then(|s| s.parse::<i64>().ok()) {
                    Some(n) => n,
                    None => {
                        return refuse(format!(
                            "key {key:?} holds {} bytes that are not an integer counter",
                            v.len()
                        ))
                    }
                },
            };
            let Some(new) = old.checked_add(delta) else {
                return refuse(format!("{old} + {delta} overflows i64 for key {key:?}"));
            };
            st.data.insert(key, new.to_string().into_bytes());
            drop(st);
            shared.changed.notify_all();
            ok().i64(new)
        }
        OP_CHECK => {
            let keys = d.keys()?;
            d.end()?;
            let st = shared.lock();
            ok().u8(keys.iter().all(|k| st.data.contains_key(k)) as u8)
        }
        OP_WAIT => {
            let keys = d.keys()?;
            let timeout = d.millis()?;
            d.end()?;
            match shared.wait_until(timeout, |st| keys.iter().all(|k| st.data.contains_key(k))) {
                None => return Ok(None),
                Some((true, _)) => ok(),
                Some((false, st)) => {
                    let missing: Vec<&String> =
                        keys.iter().filter(|k| !st.data.contains_key(*k)).collect();
                    Enc::default().u8(ST_TIMEOUT).keys(&missing)
                }
            }
        }
        OP_BARRIER => {
            let key = d.string()?;
            let target = d.u64()?;
            let timeout = d.millis()?;
            d.end()?;
            let count = |st: &State| {
                st.data
                    .get(&key)
                    .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            {
                let mut st = shared.lock();
                let n = count(&st) + 1;
                st.data.insert(key.clone(), n.to_string().into_bytes());
            }
            shared.changed.notify_all();
            match shared.wait_until(timeout, |st| count(st) >= target) {
                None => return Ok(None),
                Some((true, _)) => ok(),
                Some((false, st)) => Enc::default().u8(ST_TIMEOUT).u64(count(&st)),
            }
        }
        OP_DELETE => {
            let key = d.string()?;
            d.end()?;
            let existed = shared.lock().data.remove(&key).is_some();
            ok().u8(existed as u8)
        }
        op => return Err(format!("unknown op code {op}")),
    };
    Ok(Some(reply.0))
}

// ---------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------

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
        let mut store = Self {
            addr: addr.to_string(),
            conn: Mutex::new(Some(stream)),
            timeout,
            world_size: 0,
            barrier_rounds: Mutex::new(HashMap::new()),
            local_addr: None,
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
        // Close our own connection first so the server's drain does not wait on it.
        if let Some(s) = self.conn.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
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

// ---------------------------------------------------------------------------
// torchrun environment
// ---------------------------------------------------------------------------

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
    use super::*;

    const T: Duration = Duration::from_secs(5);

    fn server(world: usize) -> (TcpStore, String) {
        let s = TcpStore::server("127.0.0.1:0", world, T).unwrap();
        let addr = s.local_addr().unwrap().to_string();
        (s, addr)
    }

    #[test]
    fn set_get_check_delete_add() {
        let (s, addr) = server(2);
        let c = TcpStore::client(&addr, T).unwrap();
        assert_eq!(c.world_size(), 2);
        assert!(s.is_server() && !c.is_server());
        s.set("a", b"hello").unwrap();
        assert_eq!(c.get("a").unwrap(), b"hello");
        c.set("a", b"").unwrap();
        assert_eq!(s.get("a").unwrap(), b"");
        assert!(c.check(&["a"]).unwrap());
        assert!(!c.check(&["a", "b"]).unwrap());
        assert!(c.check::<&str>(&[]).unwrap());
        assert_eq!(c.add("n", 5).unwrap(), 5);
        assert_eq!(s.add("n", -2).unwrap(), 3);
        assert_eq!(c.get("n").unwrap(), b"3");
        assert!(c.delete_key("n").unwrap());
        assert!(!c.delete_key("n").unwrap());
        let big = vec![0xabu8; 1 << 20];
        c.set("big", &big).unwrap();
        assert_eq!(s.get("big").unwrap(), big);
    }

    #[test]
    fn add_on_non_counter_is_a_server_error_and_store_stays_usable() {
        let (s, _) = server(1);
        s.set("text", b"abc").unwrap();
        let e = s.add("text", 1).unwrap_err();
        assert!(matches!(e, RendezvousError::Server { .. }), "{e}");
        assert!(e.to_string().contains("\"text\""), "{e}");
        assert_eq!(s.add("ok", 1).unwrap(), 1);
    }

    #[test]
    fn many_threads_add_get_wait_barrier() {
        let world = 6;
        let (s, addr) = server(world);
        thread::scope(|sc| {
            for r in 0..world {
                let addr = addr.clone();
                let s = &s;
                sc.spawn(move || {
                    let own;
                    let c = if r == 0 {
                        s
                    } else {
                        own = TcpStore::client(&addr, T).unwrap();
                        &own
                    };
                    // Wait before anyone may have set: the server wakes us.
                    let keys: Vec<String> = (0..world).map(|i| format!("v/{i}")).collect();
                    c.set(&format!("v/{r}"), format!("{}", r * 10).as_bytes()).unwrap();
                    c.wait(&keys, T).unwrap();
                    let sum: usize = (0..world)
                        .map(|i| {
                            let v = c.get(&format!("v/{i}")).unwrap();
                            String::from_utf8(v).unwrap().parse::<usize>().unwrap()
                        })
                        .sum();
                    assert_eq!(sum, 10 * world * (world - 1) / 2);
                    for _ in 0..20 {
                        c.add("counter", 1).unwrap();
                    }
                    c.barrier("counted").unwrap();
                    assert_eq!(c.get("counter").unwrap(), (20 * world).to_string().into_bytes());
                    // Reusing a barrier name joins its next round.
                    c.barrier("counted").unwrap();
                    c.barrier("counted").unwrap();
                });
            }
        });
    }

    #[test]
    fn get_timeout_names_the_key() {
        let (s, _) = server(1);
        let t0 = Instant::now();
        let e = s.get_timeout("nccl_id/tp", Duration::from_millis(200)).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(3));
        assert!(matches!(e, RendezvousError::Timeout { .. }), "{e}");
        let m = e.to_string();
        assert!(m.contains("nccl_id/tp") && m.contains("200ms") && m.contains("get"), "{m}");
        // The connection is still in step after a server-side timeout.
        s.set("x", b"1").unwrap();
        assert_eq!(s.get("x").unwrap(), b"1");
    }

    #[test]
    fn wait_timeout_names_only_missing_keys() {
        let (s, _) = server(1);
        s.set("here", b"").unwrap();
        let e = s.wait(&["here", "absent"], Duration::from_millis(100)).unwrap_err();
        match &e {
            RendezvousError::Timeout { keys, op, .. } => {
                assert_eq!(keys, &["absent".to_string()]);
                assert_eq!(*op, "wait");
            }
            _ => panic!("{e}"),
        }
    }

    #[test]
    fn barrier_timeout_says_who_arrived() {
        let (s, _) = server(3);
        let e = s.barrier_timeout("init", Duration::from_millis(100)).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("\"init\"") && m.contains("1 of 3"), "{m}");
    }

    #[test]
    fn client_to_closed_port_errors_within_timeout() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let addr = format!("127.0.0.1:{port}");
        let t0 = Instant::now();
        let e = TcpStore::client(&addr, Duration::from_millis(300)).unwrap_err();
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(2), "{took:?}");
        assert!(matches!(e, RendezvousError::Connect { attempts, .. } if attempts > 1), "{e}");
        assert!(e.to_string().contains(&addr), "{e}");
    }

    #[test]
    fn client_retries_until_server_starts() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let addr = format!("127.0.0.1:{port}");
        let late = thread::spawn({
            let addr = addr.clone();
            move || {
                thread::sleep(Duration::from_millis(200));
                TcpStore::server(&addr, 2, T)
            }
        });
        let c = TcpStore::client(&addr, T).unwrap();
        let s = late.join().unwrap().unwrap();
        c.set("k", b"v").unwrap();
        assert_eq!(s.get("k").unwrap(), b"v");
    }

    #[test]
    fn server_dropped_mid_wait_is_an_error_not_a_hang() {
        let (s, addr) = server(2);
        let c = TcpStore::client(&addr, Duration::from_secs(30)).unwrap();
        let waiter = thread::spawn(move || {
            let t0 = Instant::now();
            (c.get("never"), t0.elapsed(), c)
        });
        thread::sleep(Duration::from_millis(150));
        drop(s);
        let (r, took, c) = waiter.join().unwrap();
        let e = r.unwrap_err();
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert!(matches!(e, RendezvousError::ServerGone { .. }), "{e}");
        assert!(e.to_string().contains("never"), "{e}");
        // Later use reports the closed connection.
        assert!(matches!(c.set("a", b""), Err(RendezvousError::Closed { .. })));
    }

    #[test]
    fn server_answers_satisfied_barrier_before_shutdown() {
        // The hosting rank drops its store right after its barrier returns;
        // the other ranks must still get their answer.
        for _ in 0..20 {
            let (s, addr) = server(4);
            let clients: Vec<_> = (1..4).map(|_| TcpStore::client(&addr, T).unwrap()).collect();
            let hs: Vec<_> =
                clients.into_iter().map(|c| thread::spawn(move || c.barrier("exit"))).collect();
            s.barrier("exit").unwrap();
            drop(s);
            for h in hs {
                h.join().unwrap().unwrap();
            }
        }
    }

    #[test]
    fn malformed_and_foreign_peers_get_typed_errors() {
        // A server that is not a tpar store.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let junk = thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 64];
            let _ = s.read(&mut buf);
            s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
        });
        let e = TcpStore::client(&addr, Duration::from_secs(2)).unwrap_err();
        assert!(matches!(e, RendezvousError::Protocol { .. }), "{e}");
        junk.join().unwrap();

        // A client sending garbage gets an error reply, and the server lives on.
        let (s, addr) = server(1);
        let mut raw = TcpStream::connect(&addr).unwrap();
        write_frame(&mut raw, &[42, 1, 2]).unwrap();
        let reply = match read_frame(&mut raw) {
            Ok(b) => b,
            Err(_) => panic!("no reply"),
        };
        assert_eq!(reply[0], ST_ERROR);
        raw.write_all(&u32::MAX.to_be_bytes()).ok();
        s.set("still", b"alive").unwrap();
        assert_eq!(s.get("still").unwrap(), b"alive");
    }

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
