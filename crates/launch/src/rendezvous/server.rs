//! The store's server: an accept loop and one thread per connection, over a map guarded
//! by a mutex and a condition variable that wakes waiting requests.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::wire::*;

#[derive(Default)]
struct State {
    data: HashMap<String, Vec<u8>>,
    shutdown: bool,
    /// Connection threads still running.
    live: usize,
    /// The joined ranks: each rank's connection (its peer address).
    ranks: HashMap<u64, String>,
    /// Why the job failed, once it has: every waiting request (and every later one that
    /// would wait) is answered with it.
    failure: Option<Failure>,
}

/// Why the job failed, as every rank is told.
#[derive(Clone)]
struct Failure {
    /// [`FAIL_GONE`] or [`FAIL_MISMATCH`].
    kind: u8,
    /// The rank concerned (the one that died, or that joined last).
    rank: u64,
    message: String,
}

impl Failure {
    fn reply(&self) -> Enc {
        Enc::default().u8(ST_FAILED).u8(self.kind).u64(self.rank).bytes(self.message.as_bytes())
    }
}

/// How a wait of [`Shared::wait_until`] ended.
enum Waited<'a> {
    Ready(MutexGuard<'a, State>),
    TimedOut(MutexGuard<'a, State>),
    Failed(Failure),
    Shutdown,
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

    /// Waits until `ready` holds, the deadline passes, the job fails or the server
    /// shuts down. `ready` is checked first, so requests satisfied at shutdown time (or
    /// when a rank dies right after a barrier it completed) still get their answer.
    fn wait_until(&self, timeout: Duration, mut ready: impl FnMut(&State) -> bool) -> Waited<'_> {
        let deadline = Instant::now().checked_add(timeout);
        let mut st = self.lock();
        loop {
            if ready(&st) {
                return Waited::Ready(st);
            }
            if let Some(f) = &st.failure {
                return Waited::Failed(f.clone());
            }
            if st.shutdown {
                return Waited::Shutdown;
            }
            let wait = match deadline {
                None => Duration::from_secs(3600),
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left,
                    _ => return Waited::TimedOut(st),
                },
            };
            st = self.changed.wait_timeout(st, wait).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Marks the job failed (the first failure is kept) and wakes every waiting request.
    fn fail(&self, mut st: MutexGuard<'_, State>, failure: Failure) -> Failure {
        let f = st.failure.get_or_insert(failure).clone();
        drop(st);
        self.changed.notify_all();
        f
    }
}

/// The listening half of a store, owned by the rank that hosts it.
pub(super) struct Server {
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl Server {
    pub(super) fn start(listener: TcpListener, world_size: u64) -> io::Result<Self> {
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

/// One client connection: read a request, answer it, until the peer leaves. A joined
/// rank whose connection closes without a goodbye (its process died, or dropped the
/// connection without dropping its store) fails the job, naming the rank.
fn serve_connection(mut stream: TcpStream, shared: Arc<Shared>) {
    let peer = stream.peer_addr().map_or_else(|_| "an unknown address".into(), |a| a.to_string());
    let mut joined: Option<u64> = None;
    let mut bye = false;
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
        let reply = match body.first() {
            Some(&OP_BYE) => {
                bye = true;
                break;
            }
            Some(&OP_JOIN) => join(&shared, &body, &peer, &mut joined),
            _ => handle(&shared, &body),
        };
        match reply {
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
    let mut st = shared.lock();
    st.live -= 1;
    if let Some(rank) = joined {
        if st.ranks.get(&rank) == Some(&peer) {
            st.ranks.remove(&rank);
            if !bye && !st.shutdown {
                let message = format!(
                    "rank {rank}'s connection to the store (from {peer}) closed without a \
                     goodbye: its process died"
                );
                shared.fail(st, Failure { kind: FAIL_GONE, rank, message });
                return;
            }
        }
    }
    drop(st);
    shared.changed.notify_all();
}

/// Registers the connection from `peer` as a rank: refuses (and fails the job with) a
/// world size other than the store's, or a rank another live connection holds.
fn join(
    shared: &Shared,
    body: &[u8],
    peer: &str,
    joined: &mut Option<u64>,
) -> Result<Option<Vec<u8>>, String> {
    let mut d = Dec(body);
    d.u8()?;
    let rank = d.u64()?;
    let world = d.u64()?;
    d.end()?;
    let mut st = shared.lock();
    let mismatch = if world != shared.world_size {
        Some(format!(
            "world sizes differ: rank {rank} was started with WORLD_SIZE={world}, but the \
             store's host (rank 0) with WORLD_SIZE={}",
            shared.world_size
        ))
    } else if rank >= world {
        Some(format!("rank {rank} is out of range for WORLD_SIZE={world}"))
    } else {
        match st.ranks.get(&rank) {
            Some(other) if other != peer => Some(format!(
                "RANK={rank} is claimed by two processes (connections from {other} and \
                 {peer}): each process needs its own rank below WORLD_SIZE={world}"
            )),
            _ => None,
        }
    };
    if let Some(message) = mismatch {
        let f = shared.fail(st, Failure { kind: FAIL_MISMATCH, rank, message });
        // This rank hears its own problem, even when another failure came first.
        let own = if f.rank == rank {
            f
        } else {
            Failure { kind: FAIL_MISMATCH, rank, message: f.message }
        };
        return Ok(Some(own.reply().0));
    }
    if let Some(f) = &st.failure {
        return Ok(Some(f.reply().0));
    }
    st.ranks.insert(rank, peer.to_string());
    *joined = Some(rank);
    Ok(Some(Enc::default().u8(ST_OK).0))
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
                Waited::Shutdown => return Ok(None),
                Waited::Failed(f) => f.reply(),
                Waited::Ready(st) => ok().bytes(&st.data[&key]),
                Waited::TimedOut(_) => Enc::default().u8(ST_TIMEOUT),
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
                Waited::Shutdown => return Ok(None),
                Waited::Failed(f) => f.reply(),
                Waited::Ready(_) => ok(),
                Waited::TimedOut(st) => {
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
                Waited::Shutdown => return Ok(None),
                Waited::Failed(f) => f.reply(),
                Waited::Ready(_) => ok(),
                Waited::TimedOut(st) => Enc::default().u8(ST_TIMEOUT).u64(count(&st)),
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
