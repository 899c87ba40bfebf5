//! The TCP connections of one process's world: one socket per pair of processes, set up
//! through the [`Store`], each read by a thread that files incoming frames by group and
//! channel, and written under a lock per socket.
//!
//! # Setup
//!
//! Every process listens on an ephemeral port and publishes `host:port` under
//! `tpar/tcp/addr/<rank>`; rank 0 also publishes a random job token under
//! `tpar/tcp/token`. Each process then connects to every higher rank and accepts one
//! connection from every lower rank. The connecting side opens with a hello (magic, byte
//! order, job token, world size, its rank, the rank it means to reach); the accepting side
//! refuses a hello that is not for this job, this world size and this rank, or that comes
//! from a rank it does not expect (or already has), and answers an accepted one with its
//! own rank, which the connecting side checks in turn.
//!
//! # Frames
//!
//! Every message is a frame: a 24-byte header (group id, payload length, channel, magic)
//! and the payload bytes. The reader thread of a socket appends each payload to the queue
//! of `(peer, group id, channel)`, so groups sharing a socket (the world and its
//! sub-groups) and a group's collectives and point-to-point messages never take each
//! other's data; TCP keeps each queue in the order it was sent. Large payloads are read
//! into buffers the consumers hand back once they have used them ([`Mesh::recycle`]), so
//! repeated collectives of the same size read into memory that is already mapped instead
//! of faulting in a fresh allocation per frame. A socket that ends or
//! fails marks its peer gone: every wait on that peer then fails with
//! [`CollectiveError::PeerFailed`] naming its global rank, at once.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::ToSocketAddrs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::TCP_HOST_ENV;
use crate::remote::exec::Deadline;
use crate::{CollectiveError, Result, Store, StoreError};

/// Opens every frame's header (`"tpF1"`).
const FRAME_MAGIC: u32 = 0x7470_4631;
/// Bytes of a frame header.
const FRAME_HEADER: usize = 24;
/// Payloads up to this size are written together with their header.
const SMALL_FRAME: usize = 4 << 10;
/// Opens a hello (`"tparTCP"` and version 1).
const HELLO_MAGIC: [u8; 8] = *b"tparTCP\x01";
/// Written in native byte order: a peer that reads another value has another byte order.
const BYTE_ORDER: u32 = 0x0102_0304;
/// Bytes of a hello: magic, byte order, token, world size, from, to.
const HELLO_LEN: usize = 8 + 4 + 8 + 8 + 8 + 8;
/// Bytes of an answer: accepted (1 or 0), the acceptor's rank.
const ANSWER_LEN: usize = 1 + 8;

/// The store key of `rank`'s listening address.
fn addr_key(rank: usize) -> String {
    format!("tpar/tcp/addr/{rank}")
}

const TOKEN_KEY: &str = "tpar/tcp/token";

/// Which stream of a group a frame belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Channel {
    /// Collectives (header exchanges and data), in call order.
    Collective = 0,
    /// `send`/`recv` and their shaped variants.
    P2p = 1,
}

/// `(peer global rank, group id, channel)`.
type QueueKey = (usize, u64, u8);

#[derive(Default)]
struct InboxState {
    queues: HashMap<QueueKey, VecDeque<Vec<u8>>>,
    /// Peers whose connection ended, and how.
    gone: HashMap<usize, String>,
}

/// Payloads below this size are plain allocations (the allocator serves them from its
/// heap, already mapped); larger ones go through the [`Pool`].
const POOLED_MIN: usize = 64 << 10;
/// The most bytes the pool keeps between frames.
const POOL_MAX_BYTES: usize = 512 << 20;

/// Receive buffers handed back by the consumers of frames, for the reader threads to
/// reuse: a fresh large allocation is a new mapping that faults in page by page as it is
/// written, several times slower than a copy into mapped memory. Holds at most
/// `max_bufs` buffers and [`POOL_MAX_BYTES`] bytes, dropping the oldest first.
#[derive(Default)]
struct Pool {
    bufs: VecDeque<Vec<u8>>,
    bytes: usize,
    max_bufs: usize,
}

impl Pool {
    /// A buffer of exactly `len` initialized bytes (contents unspecified), reusing the
    /// smallest kept buffer that holds `len`; `None` when none does.
    fn get(&mut self, len: usize) -> Option<Vec<u8>> {
        let (i, _) = self
            .bufs
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())?;
        let mut b = self.bufs.remove(i)?;
        self.bytes -= b.capacity();
        // Equal sizes (the steady state of repeated collectives) reuse the bytes as they
        // are; otherwise only the part past the buffer's length is zeroed.
        b.resize(len, 0);
        Some(b)
    }

    fn put(&mut self, b: Vec<u8>) {
        if b.capacity() < POOLED_MIN || b.capacity() > POOL_MAX_BYTES || self.max_bufs == 0 {
            return;
        }
        self.bytes += b.capacity();
        self.bufs.push_back(b);
        while self.bufs.len() > self.max_bufs || self.bytes > POOL_MAX_BYTES {
            match self.bufs.pop_front() {
                Some(old) => self.bytes -= old.capacity(),
                None => break,
            }
        }
    }
}

/// What the reader threads have received, and which peers are gone.
#[derive(Default)]
struct Inbox {
    state: Mutex<InboxState>,
    cv: Condvar,
    pool: Mutex<Pool>,
}

impl Inbox {
    fn lock(&self) -> MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn pool(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn mark_gone(&self, peer: usize, why: String) {
        self.lock().gone.entry(peer).or_insert(why);
        self.cv.notify_all();
    }
}

/// This process's connections to every other process of the world.
pub(crate) struct Mesh {
    rank: usize,
    /// How long a write may wait for a peer to take the bytes.
    write_timeout: Duration,
    /// The writing side of each peer's socket (`None` for this process).
    writers: Vec<Option<Mutex<TcpStream>>>,
    inbox: Arc<Inbox>,
}

/// An error of the world's setup, before any group exists.
fn setup_err(rank: usize, size: usize, message: String) -> CollectiveError {
    CollectiveError::Backend {
        backend: "tcp",
        op: "tcp_world",
        group: (0..size).collect(),
        rank,
        message,
    }
}

fn setup_timeout(size: usize, waiting_for: Vec<usize>, after: Duration) -> CollectiveError {
    CollectiveError::Timeout { op: "tcp_world", group: (0..size).collect(), waiting_for, after }
}

/// The address this process advertises (host text) and the address it binds.
fn listen_addrs(store: &dyn Store) -> std::result::Result<(String, SocketAddr), String> {
    let (host, ip) = match std::env::var(TCP_HOST_ENV) {
        Ok(h) if !h.trim().is_empty() => {
            let h = h.trim().trim_start_matches('[').trim_end_matches(']').to_string();
            let ip = match h.parse::<IpAddr>() {
                Ok(ip) => ip,
                Err(_) => (h.as_str(), 0)
                    .to_socket_addrs()
                    .map_err(|e| format!("{TCP_HOST_ENV}={h:?} does not resolve: {e}"))?
                    .next()
                    .map(|a| a.ip())
                    .ok_or_else(|| format!("{TCP_HOST_ENV}={h:?} resolves to no address"))?,
            };
            (h, ip)
        }
        _ => {
            let ip = store.local_ip().unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
            (ip.to_string(), ip)
        }
    };
    let bind = match ip {
        ip if ip.is_loopback() => SocketAddr::new(ip, 0),
        IpAddr::V4(_) => SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0),
        IpAddr::V6(_) => SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), 0),
    };
    Ok((host, bind))
}

/// `host:port`, bracketing IPv6 literals.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A token no other job is likely to share.
fn new_token() -> u64 {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

struct Hello {
    token: u64,
    size: u64,
    from: u64,
    to: u64,
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(&HELLO_MAGIC);
        b[8..12].copy_from_slice(&BYTE_ORDER.to_ne_bytes());
        b[12..20].copy_from_slice(&self.token.to_le_bytes());
        b[20..28].copy_from_slice(&self.size.to_le_bytes());
        b[28..36].copy_from_slice(&self.from.to_le_bytes());
        b[36..44].copy_from_slice(&self.to.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HELLO_LEN]) -> std::result::Result<Hello, String> {
        if b[..8] != HELLO_MAGIC {
            return Err("not a tpar tcp hello".into());
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        if b[8..12] != BYTE_ORDER.to_ne_bytes() {
            return Err("the peer has another byte order".into());
        }
        Ok(Hello { token: u64_at(12), size: u64_at(20), from: u64_at(28), to: u64_at(36) })
    }
}

impl Mesh {
    /// Connects this process (`rank` of `size`) with every other through `store`, within
    /// `timeout`.
    pub fn connect(store: &dyn Store, rank: usize, size: usize, timeout: Duration) -> Result<Mesh> {
        let fail = |m: String| setup_err(rank, size, m);
        let store_err = |what: &str, e: StoreError| fail(format!("store: {what}: {e}"));
        let deadline = Instant::now() + timeout;
        let left = || deadline.saturating_duration_since(Instant::now());

        let (host, bind) = listen_addrs(store).map_err(&fail)?;
        let listener =
            TcpListener::bind(bind).map_err(|e| fail(format!("listening on {bind}: {e}")))?;
        let port =
            listener.local_addr().map_err(|e| fail(format!("listener address: {e}")))?.port();
        let token = if rank == 0 {
            let t = new_token();
            store
                .set(TOKEN_KEY, &t.to_le_bytes())
                .map_err(|e| store_err("publishing the job token", e))?;
            t
        } else {
            match store.get_timeout(TOKEN_KEY, left()) {
                Ok(v) => u64::from_le_bytes(
                    v.as_slice()
                        .try_into()
                        .map_err(|_| fail(format!("{TOKEN_KEY} holds {} bytes, not 8", v.len())))?,
                ),
                Err(StoreError::Timeout(_)) => return Err(setup_timeout(size, vec![0], timeout)),
                Err(e) => return Err(store_err("reading the job token", e)),
            }
        };
        store
            .set(&addr_key(rank), host_port(&host, port).as_bytes())
            .map_err(|e| store_err("publishing this rank's address", e))?;

        // Lower ranks connect to us (accepted on a thread); we connect to higher ranks.
        let acceptor = {
            let want = Hello { token, size: size as u64, from: 0, to: rank as u64 };
            thread::Builder::new()
                .name(format!("tpar-tcp-accept-{rank}"))
                .spawn(move || accept_lower(listener, &want, rank, deadline))
                .map_err(|e| fail(format!("cannot start the accepting thread: {e}")))?
        };
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        let mut first_err: Option<CollectiveError> = None;
        for peer in rank + 1..size {
            let addr = match store.get_timeout(&addr_key(peer), left()) {
                Ok(v) => String::from_utf8_lossy(&v).into_owned(),
                Err(StoreError::Timeout(_)) => {
                    first_err = Some(setup_timeout(size, vec![peer], timeout));
                    break;
                }
                Err(e) => {
                    first_err = Some(store_err(&format!("reading rank {peer}'s address"), e));
                    break;
                }
            };
            let hello = Hello { token, size: size as u64, from: rank as u64, to: peer as u64 };
            match connect_to(&addr, &hello, deadline) {
                Ok(s) => streams[peer] = Some(s),
                Err(ConnectError::Timeout(why)) => {
                    let _ = why;
                    first_err = Some(setup_timeout(size, vec![peer], timeout));
                    break;
                }
                Err(ConnectError::Failed(why)) => {
                    first_err = Some(fail(format!("connecting to rank {peer} at {addr}: {why}")));
                    break;
                }
            }
        }
        let accepted = acceptor
            .join()
            .unwrap_or_else(|_| Err(AcceptError::Failed("the accepting thread panicked".into())));
        if let Some(e) = first_err {
            return Err(e);
        }
        match accepted {
            Ok(lower) => {
                for (r, s) in lower {
                    streams[r] = Some(s);
                }
            }
            Err(AcceptError::Missing(missing)) => {
                return Err(setup_timeout(size, missing, timeout))
            }
            Err(AcceptError::Failed(why)) => return Err(fail(why)),
        }

        let inbox = Arc::new(Inbox::default());
        // Enough for one large frame from every peer in each of two steps in flight.
        inbox.pool().max_bufs = 2 * size.saturating_sub(1);
        let write_timeout = timeout.max(Duration::from_millis(100));
        let mut writers = Vec::with_capacity(size);
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                writers.push(None);
                continue;
            };
            let _ = s.set_nodelay(true);
            let _ = s.set_read_timeout(None);
            let _ = s.set_write_timeout(Some(write_timeout));
            let reader = s.try_clone().map_err(|e| fail(format!("socket of rank {peer}: {e}")))?;
            let ib = inbox.clone();
            thread::Builder::new()
                .name(format!("tpar-tcp-read-{rank}-{peer}"))
                .spawn(move || read_loop(reader, peer, &ib))
                .map_err(|e| {
                    fail(format!("cannot start the reading thread of rank {peer}: {e}"))
                })?;
            writers.push(Some(Mutex::new(s)));
        }
        Ok(Mesh { rank, write_timeout, writers, inbox })
    }

    /// Why `peer` is gone, if it is.
    fn gone(&self, peer: usize) -> Option<String> {
        self.inbox.lock().gone.get(&peer).cloned()
    }

    /// Sends one frame to global rank `peer`. Fails with `PeerFailed` when the peer is
    /// gone (or the write fails: the peer is then marked gone), `Timeout` when the peer
    /// does not take the bytes within the socket's write timeout.
    pub fn post(
        &self,
        op: &'static str,
        group: &[usize],
        peer: usize,
        gid: u64,
        chan: Channel,
        payload: &[u8],
    ) -> Result<()> {
        let failed = |why: String| CollectiveError::PeerFailed {
            op,
            group: group.to_vec(),
            rank: peer,
            why,
        };
        if let Some(why) = self.gone(peer) {
            return Err(failed(why));
        }
        let Some(Some(w)) = self.writers.get(peer) else {
            return Err(CollectiveError::InvalidArgument {
                op,
                why: format!(
                    "internal error: no connection from rank {} to rank {peer}",
                    self.rank
                ),
            });
        };
        let mut h = [0u8; FRAME_HEADER];
        h[..8].copy_from_slice(&gid.to_le_bytes());
        h[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        h[16..20].copy_from_slice(&(chan as u32).to_le_bytes());
        h[20..24].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        let mut s = w.lock().unwrap_or_else(PoisonError::into_inner);
        // A small frame leaves in one write (one segment with TCP_NODELAY); a large one
        // as the header and then the caller's bytes, uncopied.
        let wrote = if payload.len() <= SMALL_FRAME {
            let mut frame = [0u8; FRAME_HEADER + SMALL_FRAME];
            frame[..FRAME_HEADER].copy_from_slice(&h);
            frame[FRAME_HEADER..FRAME_HEADER + payload.len()].copy_from_slice(payload);
            s.write_all(&frame[..FRAME_HEADER + payload.len()])
        } else {
            s.write_all(&h).and_then(|()| s.write_all(payload))
        };
        match wrote {
            Ok(()) => Ok(()),
            Err(e) => {
                // A partial frame leaves the stream unusable: close it for both sides.
                let _ = s.shutdown(Shutdown::Both);
                drop(s);
                let timed_out =
                    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut);
                let why = if timed_out {
                    format!("it took no data for {:?} (connection closed)", self.write_timeout)
                } else {
                    format!("sending to it failed: {e}")
                };
                self.inbox.mark_gone(peer, why.clone());
                if timed_out {
                    Err(CollectiveError::Timeout {
                        op,
                        group: group.to_vec(),
                        waiting_for: vec![peer],
                        after: self.write_timeout,
                    })
                } else {
                    Err(failed(why))
                }
            }
        }
    }

    /// Hands back payloads returned by [`take`](Self::take) once they are used, for the
    /// reader threads to receive into again.
    pub fn recycle(&self, payloads: impl IntoIterator<Item = Vec<u8>>) {
        let mut pool = self.inbox.pool();
        for p in payloads {
            pool.put(p);
        }
    }

    /// Takes the next frame of `(peer, gid, chan)` from each global rank of `peers`
    /// (distinct), in that order, waiting until all have one. Fails with `PeerFailed`
    /// as soon as an awaited peer with nothing queued is gone, and with `Timeout` naming
    /// the peers that sent nothing when `deadline` passes; takes nothing then.
    pub fn take(
        &self,
        op: &'static str,
        group: &[usize],
        peers: &[usize],
        gid: u64,
        chan: Channel,
        deadline: Deadline,
    ) -> Result<Vec<Vec<u8>>> {
        let key = |p: usize| (p, gid, chan as u8);
        let mut st = self.inbox.lock();
        loop {
            let missing: Vec<usize> = peers
                .iter()
                .copied()
                .filter(|&p| st.queues.get(&key(p)).is_none_or(VecDeque::is_empty))
                .collect();
            if missing.is_empty() {
                let mut out = Vec::with_capacity(peers.len());
                for &p in peers {
                    let q = st.queues.get_mut(&key(p));
                    out.push(q.and_then(VecDeque::pop_front).unwrap_or_default());
                }
                return Ok(out);
            }
            if let Some((&p, why)) = missing.iter().find_map(|p| st.gone.get_key_value(p)) {
                return Err(CollectiveError::PeerFailed {
                    op,
                    group: group.to_vec(),
                    rank: p,
                    why: why.clone(),
                });
            }
            st = match deadline.at {
                None => self.inbox.cv.wait(st).unwrap_or_else(PoisonError::into_inner),
                Some(at) => {
                    let now = Instant::now();
                    if now >= at {
                        return Err(CollectiveError::Timeout {
                            op,
                            group: group.to_vec(),
                            waiting_for: missing,
                            after: deadline.timeout,
                        });
                    }
                    self.inbox
                        .cv
                        .wait_timeout(st, at - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
    }
}

impl Drop for Mesh {
    /// Ends this process's side of every connection: peers read the end of the stream
    /// (after everything sent before it) and count this process gone. The reading side
    /// stays open until the peer ends its side too.
    fn drop(&mut self) {
        for w in self.writers.iter().flatten() {
            let s = w.lock().unwrap_or_else(PoisonError::into_inner);
            let _ = s.shutdown(Shutdown::Write);
        }
    }
}

/// Reads frames from `peer` until its stream ends or fails, then marks it gone.
fn read_loop(mut s: TcpStream, peer: usize, inbox: &Inbox) {
    let why = loop {
        let mut h = [0u8; FRAME_HEADER];
        match s.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                break "its connection closed (the process exited or dropped its world)".to_string()
            }
            Err(e) => break format!("its connection failed: {e}"),
        }
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap_or([0; 8]));
        let magic = u32::from_le_bytes(h[20..24].try_into().unwrap_or([0; 4]));
        let chan = u32::from_le_bytes(h[16..20].try_into().unwrap_or([0; 4]));
        if magic != FRAME_MAGIC || chan > 1 {
            break format!("it sent a malformed frame header {h:02x?}");
        }
        let (gid, len) = (u64_at(0), u64_at(8));
        let Ok(len) = usize::try_from(len) else {
            break format!("it sent a frame of {len} bytes");
        };
        let pooled = if len >= POOLED_MIN { inbox.pool().get(len) } else { None };
        let read = match pooled {
            Some(mut payload) => s.read_exact(&mut payload).map(|()| (payload, len)),
            None => {
                let mut payload = Vec::new();
                if let Err(e) = payload.try_reserve_exact(len) {
                    break format!("a frame of {len} bytes does not fit in memory: {e}");
                }
                (&mut s).take(len as u64).read_to_end(&mut payload).map(|n| (payload, n))
            }
        };
        let payload = match read {
            Ok((payload, n)) if n == len => payload,
            Ok((_, n)) => {
                break format!(
                    "its connection closed in the middle of a frame ({n} of {len} bytes)"
                )
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                break format!("its connection closed in the middle of a frame of {len} bytes")
            }
            Err(e) => break format!("its connection failed: {e}"),
        };
        inbox.lock().queues.entry((peer, gid, chan as u8)).or_default().push_back(payload);
        inbox.cv.notify_all();
    };
    inbox.mark_gone(peer, why);
}

enum ConnectError {
    Timeout(String),
    Failed(String),
}

/// Connects to `addr` and shakes hands, retrying refused connections until `deadline`.
fn connect_to(
    addr: &str,
    hello: &Hello,
    deadline: Instant,
) -> std::result::Result<TcpStream, ConnectError> {
    let mut backoff = Duration::from_millis(5);
    let mut last = String::from("no attempt");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ConnectError::Timeout(last));
        }
        let attempt = addr
            .to_socket_addrs()
            .map_err(|e| ConnectError::Failed(format!("does not resolve: {e}")))?
            .next()
            .ok_or_else(|| ConnectError::Failed("resolves to no address".into()))
            .and_then(|a| {
                TcpStream::connect_timeout(&a, left.max(Duration::from_millis(1)))
                    .map_err(|e| ConnectError::Timeout(e.to_string()))
            });
        match attempt {
            Ok(mut s) => {
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(10));
                let _ = s.set_read_timeout(Some(left));
                let _ = s.set_write_timeout(Some(left));
                s.write_all(&hello.encode())
                    .map_err(|e| ConnectError::Failed(format!("sending the hello: {e}")))?;
                let mut answer = [0u8; ANSWER_LEN];
                match s.read_exact(&mut answer) {
                    Ok(()) => {}
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                    {
                        return Err(ConnectError::Timeout(format!("no answer to the hello: {e}")))
                    }
                    Err(e) => {
                        return Err(ConnectError::Failed(format!(
                            "the peer refused the hello (wrong job, world size or rank?): {e}"
                        )))
                    }
                }
                let who = u64::from_le_bytes(answer[1..].try_into().unwrap_or([0; 8]));
                if answer[0] != 1 || who != hello.to {
                    return Err(ConnectError::Failed(format!(
                        "the peer answered as rank {who} (accepted: {}), expected rank {}",
                        answer[0] == 1,
                        hello.to
                    )));
                }
                return Ok(s);
            }
            Err(ConnectError::Timeout(why)) => last = why,
            Err(e) => return Err(e),
        }
        thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
        backoff = (backoff * 2).min(Duration::from_millis(200));
    }
}

enum AcceptError {
    /// These lower ranks did not connect in time.
    Missing(Vec<usize>),
    Failed(String),
}

/// Accepts one connection from every rank below `rank`, refusing any other.
fn accept_lower(
    listener: TcpListener,
    want: &Hello,
    rank: usize,
    deadline: Instant,
) -> std::result::Result<Vec<(usize, TcpStream)>, AcceptError> {
    let mut got: Vec<Option<TcpStream>> = (0..rank).map(|_| None).collect();
    if rank == 0 {
        return Ok(Vec::new());
    }
    listener.set_nonblocking(true).map_err(|e| AcceptError::Failed(format!("listener: {e}")))?;
    let mut pause = Duration::from_millis(1);
    while got.iter().any(Option::is_none) {
        if Instant::now() >= deadline {
            let missing = (0..rank).filter(|&r| got[r].is_none()).collect();
            return Err(AcceptError::Missing(missing));
        }
        let mut s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(20));
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(AcceptError::Failed(format!("accepting a connection: {e}"))),
        };
        pause = Duration::from_millis(1);
        let _ = s.set_nonblocking(false);
        let left =
            deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
        let _ = s.set_read_timeout(Some(left.min(Duration::from_secs(5))));
        let mut b = [0u8; HELLO_LEN];
        if s.read_exact(&mut b).is_err() {
            continue;
        }
        let from = Hello::decode(&b).ok().and_then(|h| {
            let f = usize::try_from(h.from).ok()?;
            let expected = h.token == want.token && h.size == want.size && h.to == want.to;
            (expected && f < rank && got[f].is_none()).then_some(f)
        });
        let Some(f) = from else {
            // Refused (another job, world size or rank, or a rank already connected): a
            // zero answer, then close.
            let _ = s.write_all(&[0u8; ANSWER_LEN]);
            let _ = s.shutdown(Shutdown::Both);
            continue;
        };
        let mut answer = [0u8; ANSWER_LEN];
        answer[0] = 1;
        answer[1..].copy_from_slice(&(rank as u64).to_le_bytes());
        if s.write_all(&answer).is_ok() {
            got[f] = Some(s);
        }
    }
    Ok(got.into_iter().enumerate().filter_map(|(r, s)| s.map(|s| (r, s))).collect())
}
