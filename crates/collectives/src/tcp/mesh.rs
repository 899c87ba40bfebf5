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
//! [`CollectiveError::PeerFailed`] at once, naming its global rank (or, in a
//! collective, the group's first peer to go).
//!
//! # Shared memory
//!
//! Each process also publishes its host id (`tpar/tcp/host/<rank>`, see `shm.rs`). Once
//! every socket is up, each process offers a shared-memory ring to every peer with its
//! host id and accepts the rings offered to it (offers, then answers, then their
//! answers, each phase on every socket before the next, so no order of peers can
//! deadlock). A payload of at least `ShmConfig::min_bytes` to a peer that accepted this
//! process's ring then travels through the ring, a slot-sized chunk at a time: the frame
//! header (with another magic) and an 8-byte notice per chunk still go through the
//! socket, in the frame's place in the stream, so the receiving reader thread blocks on
//! the socket as for any frame, copies each chunk out of the ring as its notice arrives,
//! frees its slot, and files the whole payload as if it had come through the socket. A
//! sender whose ring is full sleeps until a slot is freed; one that frees nothing for the
//! write timeout is treated like a socket that takes no data.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::ToSocketAddrs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::shm::{self, Ring, ShmConfig, Unlink};
use super::TCP_HOST_ENV;
use crate::remote::exec::Deadline;
use crate::{CollectiveError, Result, Store, StoreError};

/// Opens every frame's header (`"tpF1"`).
const FRAME_MAGIC: u32 = 0x7470_4631;
/// Opens the header of a frame whose payload comes through the pair's ring (`"tpS1"`).
const SHM_FRAME_MAGIC: u32 = 0x7470_5331;
/// Opens each chunk's notice (`"tpN1"`), followed by the chunk's length (u32).
const NOTE_MAGIC: u32 = 0x7470_4e31;
/// Bytes of a chunk's notice.
const NOTE_LEN: usize = 8;
/// Opens a ring offer (`"tpO1"`): flags (1: offered), nonce, name length, name.
const OFFER_MAGIC: u32 = 0x7470_4f31;
/// Bytes of a ring offer.
const OFFER_LEN: usize = 128;
/// Where a ring offer's name starts.
const OFFER_NAME_AT: usize = 24;
/// Opens the answer to a ring offer (`"tpR1"`): 1 accepted, 0 refused.
const REPLY_MAGIC: u32 = 0x7470_5231;
/// Bytes of the answer to a ring offer.
const REPLY_LEN: usize = 8;
/// The longest a sender sleeps on a full ring before it looks again whether the peer is
/// gone (its reader thread also wakes it then; this bounds a wake-up that came just
/// before the sleep).
const RING_NAP: Duration = Duration::from_millis(50);
/// Bytes of a frame header.
const FRAME_HEADER: usize = 24;
/// Payloads up to this size are written together with their header.
const SMALL_FRAME: usize = 4 << 10;
/// Opens a hello (`"tparTCP"` and version 2: the shared-memory handshake follows).
const HELLO_MAGIC: [u8; 8] = *b"tparTCP\x02";
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

/// The store key of `rank`'s host id (empty: no shared memory).
fn host_key(rank: usize) -> String {
    format!("tpar/tcp/host/{rank}")
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
    /// The peers of `gone` in the order their connections ended.
    gone_order: Vec<usize>,
}

impl InboxState {
    /// The peer a collective's failure in `group` (global ranks) is blamed on: of the
    /// group's peers that are gone, the first whose connection ended, with why. A
    /// survivor that fails because a peer died leaves too, and the others may see its
    /// connection end before they miss the dead peer (a sender blocked on the
    /// survivor's full ring, say); naming the first keeps the cause.
    fn culprit(&self, group: &[usize]) -> Option<(usize, String)> {
        let p = *self.gone_order.iter().find(|p| group.contains(p))?;
        Some((p, self.gone.get(&p)?.clone()))
    }

    /// The `PeerFailed` error of `op` in `group` on `chan` after `peer` failed with
    /// `why`: naming `peer`, or for a collective the group's first peer to go
    /// ([`InboxState::culprit`]).
    fn peer_failed(
        &self,
        op: &'static str,
        group: &[usize],
        chan: Channel,
        peer: usize,
        why: String,
    ) -> CollectiveError {
        let first = match chan {
            Channel::Collective => self.culprit(group),
            Channel::P2p => None,
        };
        let (rank, why) = first.unwrap_or((peer, why));
        CollectiveError::PeerFailed { op, group: group.to_vec(), rank, why }
    }
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
    /// Removes and returns the smallest kept buffer with room for `len` bytes.
    fn take_fit(&mut self, len: usize) -> Option<Vec<u8>> {
        let (i, _) = self
            .bufs
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())?;
        let b = self.bufs.remove(i)?;
        self.bytes -= b.capacity();
        Some(b)
    }

    /// A buffer of exactly `len` initialized bytes (contents unspecified), reusing the
    /// smallest kept buffer that holds `len`; `None` when none does.
    fn get(&mut self, len: usize) -> Option<Vec<u8>> {
        let mut b = self.take_fit(len)?;
        // Equal sizes (the steady state of repeated collectives) reuse the bytes as they
        // are; otherwise only the part past the buffer's length is zeroed.
        b.resize(len, 0);
        Some(b)
    }

    /// An empty buffer with room for `len` bytes, reusing the smallest kept buffer that
    /// has it; `None` when none does.
    fn get_empty(&mut self, len: usize) -> Option<Vec<u8>> {
        let mut b = self.take_fit(len)?;
        b.clear();
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
        let mut st = self.lock();
        if let std::collections::hash_map::Entry::Vacant(e) = st.gone.entry(peer) {
            e.insert(why);
            st.gone_order.push(peer);
        }
        drop(st);
        self.cv.notify_all();
    }
}

/// The sending side of a pair's ring.
struct Outgoing {
    ring: Arc<Ring>,
    /// Chunks sent so far (wrapping).
    sent: u32,
}

/// The receiving side of a pair's ring, owned by the pair's reader thread.
struct Incoming {
    ring: Arc<Ring>,
    /// Chunks received so far (wrapping).
    got: u32,
}

/// What a sender holds for one peer: the socket and, when the peer accepted it, the ring.
struct Writer {
    s: TcpStream,
    shm: Option<Outgoing>,
}

/// This process's connections to every other process of the world.
pub(crate) struct Mesh {
    rank: usize,
    /// How long a write may wait for a peer to take the bytes.
    write_timeout: Duration,
    /// The writing side of each peer's socket (`None` for this process).
    writers: Vec<Option<Mutex<Writer>>>,
    inbox: Arc<Inbox>,
    /// Payloads of at least this many bytes (and not empty) go through a peer's ring.
    shm_min: usize,
    /// Frames sent through rings so far.
    shm_frames: AtomicU64,
}

/// How a frame failed to leave.
enum SendFail {
    /// The socket failed (or timed out).
    Io(io::Error),
    /// The peer is gone, for this reason.
    Gone(String),
    /// The peer freed no slot of its ring for the write timeout.
    Stalled,
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
    CollectiveError::Timeout {
        op: "tcp_world",
        group: (0..size).collect(),
        waiting_for,
        after,
        chain: Vec::new(),
    }
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

/// The rings of one process, by peer: to it (accepted by the peer) and from it.
struct Rings {
    outgoing: Vec<Option<Arc<Ring>>>,
    incoming: Vec<Option<Arc<Ring>>>,
}

/// What the shared-memory handshake of [`Mesh::connect`] needs to know.
struct Handshake<'a> {
    store: &'a dyn Store,
    rank: usize,
    size: usize,
    token: u64,
    timeout: Duration,
    deadline: Instant,
    /// This process's host id; empty when shared memory is off here.
    host_id: &'a str,
}

/// A ring this process created and offered to a peer.
struct Offer {
    ring: Ring,
    /// Removes the file's name when dropped, whatever the peer answers.
    _name: Unlink,
}

impl Handshake<'_> {
    fn fail(&self, peer: usize, why: impl std::fmt::Display) -> CollectiveError {
        setup_err(self.rank, self.size, format!("shared-memory handshake with rank {peer}: {why}"))
    }

    /// Reads exactly `buf.len()` bytes from `peer` before the deadline.
    fn read(&self, s: &mut TcpStream, peer: usize, buf: &mut [u8]) -> Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        let _ = s.set_read_timeout(Some(left.max(Duration::from_millis(1))));
        s.read_exact(buf).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                setup_timeout(self.size, vec![peer], self.timeout)
            }
            _ => self.fail(peer, e),
        })
    }

    fn write(&self, s: &mut TcpStream, peer: usize, buf: &[u8]) -> Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        let _ = s.set_write_timeout(Some(left.max(Duration::from_millis(1))));
        s.write_all(buf).map_err(|e| self.fail(peer, e))
    }

    /// Whether `peer` published this process's host id (both have shared memory on).
    fn same_host(&self, peer: usize) -> Result<bool> {
        if self.host_id.is_empty() {
            return Ok(false);
        }
        let left = self.deadline.saturating_duration_since(Instant::now());
        match self.store.get_timeout(&host_key(peer), left) {
            Ok(v) => Ok(v == self.host_id.as_bytes()),
            Err(StoreError::Timeout(_)) => Err(setup_timeout(self.size, vec![peer], self.timeout)),
            Err(e) => Err(self.fail(peer, format!("store: reading its host id: {e}"))),
        }
    }

    /// Creates the ring to `peer`, or `None` when this host cannot (no `/dev/shm`, or too
    /// little room in it): the pair then keeps to its socket.
    fn create(&self, peer: usize, cfg: &ShmConfig) -> Option<(Offer, u64, String)> {
        let name = shm::file_name(std::process::id(), self.token, self.rank, peer);
        let path = shm::file_path(&name)?;
        let nonce = new_token() ^ (peer as u64).rotate_left(32);
        let ring = Ring::create(&path, nonce, cfg.slots, cfg.slot_bytes).ok()?;
        Some((Offer { ring, _name: Unlink(path) }, nonce, name))
    }

    /// Sets up the rings of every pair of processes on this host: offers one to every
    /// peer on this host, opens and answers the ones offered, reads the answers. Every
    /// pair exchanges an offer and an answer whatever its hosts, so that both sides stay
    /// in step; a ring that cannot be made or opened leaves its pair on its socket.
    fn rings(&self, streams: &mut [Option<TcpStream>], cfg: ShmConfig) -> Result<Rings> {
        let n = streams.len();
        let mut offers: Vec<Option<Offer>> = (0..n).map(|_| None).collect();
        let mut incoming: Vec<Option<Arc<Ring>>> = vec![None; n];
        // 1. Offers.
        for (peer, s) in streams.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            let mut msg = [0u8; OFFER_LEN];
            msg[..4].copy_from_slice(&OFFER_MAGIC.to_le_bytes());
            if cfg.enabled && self.same_host(peer)? {
                if let Some((offer, nonce, name)) = self.create(peer, &cfg) {
                    msg[4..8].copy_from_slice(&1u32.to_le_bytes());
                    msg[8..16].copy_from_slice(&nonce.to_le_bytes());
                    msg[16..24].copy_from_slice(&(name.len() as u64).to_le_bytes());
                    msg[OFFER_NAME_AT..OFFER_NAME_AT + name.len()].copy_from_slice(name.as_bytes());
                    offers[peer] = Some(offer);
                }
            }
            self.write(s, peer, &msg)?;
        }
        // 2. The peers' offers, answered.
        for (peer, s) in streams.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            let mut msg = [0u8; OFFER_LEN];
            self.read(s, peer, &mut msg)?;
            let u32_at =
                |i: usize| u32::from_le_bytes([msg[i], msg[i + 1], msg[i + 2], msg[i + 3]]);
            let u64_at = |i: usize| u64::from_le_bytes(msg[i..i + 8].try_into().unwrap_or([0; 8]));
            if u32_at(0) != OFFER_MAGIC {
                return Err(self.fail(peer, format!("malformed offer {:02x?}", &msg[..8])));
            }
            let name_len = usize::try_from(u64_at(16)).unwrap_or(usize::MAX);
            let name = msg
                .get(OFFER_NAME_AT..OFFER_NAME_AT.saturating_add(name_len))
                .and_then(|b| std::str::from_utf8(b).ok());
            let offered = u32_at(4) == 1 && cfg.enabled;
            let ring = name.filter(|_| offered).and_then(shm::file_path).and_then(|path| {
                let ring = Ring::open(&path, u64_at(8)).ok()?;
                // Both sides hold the ring now: its name can go.
                drop(Unlink(path));
                Some(ring)
            });
            let mut answer = [0u8; REPLY_LEN];
            answer[..4].copy_from_slice(&REPLY_MAGIC.to_le_bytes());
            answer[4..].copy_from_slice(&u32::from(ring.is_some()).to_le_bytes());
            incoming[peer] = ring.map(Arc::new);
            self.write(s, peer, &answer)?;
        }
        // 3. The answers to this process's offers.
        let mut outgoing: Vec<Option<Arc<Ring>>> = vec![None; n];
        for (peer, s) in streams.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            let mut answer = [0u8; REPLY_LEN];
            self.read(s, peer, &mut answer)?;
            let magic = u32::from_le_bytes([answer[0], answer[1], answer[2], answer[3]]);
            if magic != REPLY_MAGIC {
                return Err(self.fail(peer, format!("malformed answer {answer:02x?}")));
            }
            let accepted = answer[4..] == 1u32.to_le_bytes();
            outgoing[peer] = offers[peer].take().filter(|_| accepted).map(|o| Arc::new(o.ring));
        }
        Ok(Rings { outgoing, incoming })
    }
}

impl Mesh {
    /// Connects this process (`rank` of `size`) with every other through `store`, within
    /// `timeout`, with shared-memory rings to the peers on this host as `shm` allows.
    pub fn connect(
        store: &dyn Store,
        rank: usize,
        size: usize,
        timeout: Duration,
        shm: ShmConfig,
    ) -> Result<Mesh> {
        let fail = |m: String| setup_err(rank, size, m);
        let store_err = |what: &str, e: StoreError| match e {
            StoreError::RankGone { rank: gone, source } => CollectiveError::PeerFailed {
                op: "tcp_world",
                group: (0..size).collect(),
                rank: gone,
                why: format!("store: {what}: {source}"),
            },
            e => fail(format!("store: {what}: {e}")),
        };
        let deadline = Instant::now() + timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        // Before any wait: a store that can tell refuses a world size or rank that
        // disagrees with the others', and fails their waits with it.
        store.join(rank, size).map_err(|e| store_err("joining the job", e))?;

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
        // The host id goes first: a peer that reads this rank's address finds it set.
        let host_id = if shm.enabled { shm::host_id() } else { String::new() };
        store
            .set(&host_key(rank), host_id.as_bytes())
            .map_err(|e| store_err("publishing this rank's host id", e))?;
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

        let ctx = Handshake { store, rank, size, token, timeout, deadline, host_id: &host_id };
        let mut rings = ctx.rings(&mut streams, shm)?;

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
            let out = rings.outgoing[peer].take();
            let incoming = rings.incoming[peer].take().map(|ring| Incoming { ring, got: 0 });
            let wake = out.clone();
            thread::Builder::new()
                .name(format!("tpar-tcp-read-{rank}-{peer}"))
                .spawn(move || read_loop(reader, peer, &ib, incoming, wake))
                .map_err(|e| {
                    fail(format!("cannot start the reading thread of rank {peer}: {e}"))
                })?;
            let shm = out.map(|ring| Outgoing { ring, sent: 0 });
            writers.push(Some(Mutex::new(Writer { s, shm })));
        }
        Ok(Mesh {
            rank,
            write_timeout,
            writers,
            inbox,
            shm_min: shm.min_bytes,
            shm_frames: AtomicU64::new(0),
        })
    }

    /// The peers this process sends large payloads to through a ring.
    #[cfg(test)]
    pub fn shm_peers(&self) -> Vec<usize> {
        let lock =
            |w: &Mutex<Writer>| w.lock().unwrap_or_else(PoisonError::into_inner).shm.is_some();
        (0..self.writers.len()).filter(|&p| self.writers[p].as_ref().is_some_and(lock)).collect()
    }

    /// Frames sent through rings so far.
    #[cfg(test)]
    pub fn shm_frames(&self) -> u64 {
        self.shm_frames.load(Ordering::Relaxed)
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
        if let Some(why) = self.gone(peer) {
            return Err(self.inbox.lock().peer_failed(op, group, chan, peer, why));
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
        let mut w = w.lock().unwrap_or_else(PoisonError::into_inner);
        let Writer { s, shm } = &mut *w;
        let wrote = match shm {
            Some(out) if !payload.is_empty() && payload.len() >= self.shm_min => {
                h[20..24].copy_from_slice(&SHM_FRAME_MAGIC.to_le_bytes());
                self.send_shm(s, out, peer, &h, payload)
            }
            // A small frame leaves in one write (one segment with TCP_NODELAY); a large
            // one as the header and then the caller's bytes, uncopied.
            _ if payload.len() <= SMALL_FRAME => {
                let mut frame = [0u8; FRAME_HEADER + SMALL_FRAME];
                frame[..FRAME_HEADER].copy_from_slice(&h);
                frame[FRAME_HEADER..FRAME_HEADER + payload.len()].copy_from_slice(payload);
                s.write_all(&frame[..FRAME_HEADER + payload.len()]).map_err(SendFail::Io)
            }
            _ => s.write_all(&h).and_then(|()| s.write_all(payload)).map_err(SendFail::Io),
        };
        let Err(fail) = wrote else { return Ok(()) };
        // A partial frame leaves the stream unusable: close it for both sides.
        let _ = s.shutdown(Shutdown::Both);
        drop(w);
        let (timed_out, why) = match fail {
            SendFail::Gone(why) => (false, why),
            SendFail::Io(e)
                if !matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
            {
                (false, format!("sending to it failed: {e}"))
            }
            SendFail::Io(_) | SendFail::Stalled => {
                (true, format!("it took no data for {:?} (connection closed)", self.write_timeout))
            }
        };
        self.inbox.mark_gone(peer, why.clone());
        if timed_out {
            Err(CollectiveError::Timeout {
                op,
                group: group.to_vec(),
                waiting_for: vec![peer],
                after: self.write_timeout,
                chain: Vec::new(),
            })
        } else {
            Err(self.inbox.lock().peer_failed(op, group, chan, peer, why))
        }
    }

    /// Streams `payload` to `peer` through its ring, a slot at a time: waits for a free
    /// slot, fills it, and sends its notice (the first after the frame header `h`).
    fn send_shm(
        &self,
        s: &mut TcpStream,
        out: &mut Outgoing,
        peer: usize,
        h: &[u8; FRAME_HEADER],
        payload: &[u8],
    ) -> std::result::Result<(), SendFail> {
        let ring = out.ring.clone();
        for (i, chunk) in payload.chunks(ring.slot_bytes()).enumerate() {
            self.wait_for_slot(&ring, out.sent, peer)?;
            ring.fill(out.sent, chunk);
            out.sent = out.sent.wrapping_add(1);
            ring.set_produced(out.sent);
            let mut msg = [0u8; FRAME_HEADER + NOTE_LEN];
            msg[..FRAME_HEADER].copy_from_slice(h);
            msg[FRAME_HEADER..FRAME_HEADER + 4].copy_from_slice(&NOTE_MAGIC.to_le_bytes());
            // Chunks are at most a slot, and slots at most `MAX_SLOT_BYTES`.
            let n = u32::try_from(chunk.len()).unwrap_or(u32::MAX);
            msg[FRAME_HEADER + 4..].copy_from_slice(&n.to_le_bytes());
            let from = if i == 0 { 0 } else { FRAME_HEADER };
            s.write_all(&msg[from..]).map_err(SendFail::Io)?;
        }
        self.shm_frames.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Waits until chunk `sent` has a free slot in `ring` (fewer than `slots` chunks are
    /// unconsumed). Fails when `peer` is gone, or when it frees nothing for the write
    /// timeout.
    fn wait_for_slot(
        &self,
        ring: &Ring,
        sent: u32,
        peer: usize,
    ) -> std::result::Result<(), SendFail> {
        let mut seen = ring.consumed();
        let mut since = Instant::now();
        loop {
            let consumed = ring.consumed();
            if sent.wrapping_sub(consumed) < ring.slots() {
                return Ok(());
            }
            if consumed != seen {
                (seen, since) = (consumed, Instant::now());
            }
            if let Some(why) = self.gone(peer) {
                return Err(SendFail::Gone(why));
            }
            let left = self.write_timeout.saturating_sub(since.elapsed());
            if left.is_zero() {
                return Err(SendFail::Stalled);
            }
            ring.wait_consumed(consumed, left.min(RING_NAP));
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
                // A collective blames the group's first peer to go, which need not be
                // this one.
                return Err(st.peer_failed(op, group, chan, p, why.clone()));
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
                            chain: Vec::new(),
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
            let w = w.lock().unwrap_or_else(PoisonError::into_inner);
            let _ = w.s.shutdown(Shutdown::Write);
        }
    }
}

/// Reads frames from `peer` until its stream ends or fails, then marks it gone (and wakes
/// a sender waiting for a slot of the ring to it, `outgoing`). Frames of the peer's ring
/// are copied out of `incoming`.
fn read_loop(
    mut s: TcpStream,
    peer: usize,
    inbox: &Inbox,
    mut incoming: Option<Incoming>,
    outgoing: Option<Arc<Ring>>,
) {
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
        if !matches!(magic, FRAME_MAGIC | SHM_FRAME_MAGIC) || chan > 1 {
            break format!("it sent a malformed frame header {h:02x?}");
        }
        let (gid, len) = (u64_at(0), u64_at(8));
        let Ok(len) = usize::try_from(len) else {
            break format!("it sent a frame of {len} bytes");
        };
        let payload = if magic == SHM_FRAME_MAGIC {
            let Some(inc) = incoming.as_mut() else {
                break "it sent a frame through a shared-memory ring it never set up".to_string();
            };
            match inc.receive(&mut s, len, inbox) {
                Ok(payload) => payload,
                Err(why) => break why,
            }
        } else {
            match read_payload(&mut s, len, inbox) {
                Ok(payload) => payload,
                Err(why) => break why,
            }
        };
        inbox.lock().queues.entry((peer, gid, chan as u8)).or_default().push_back(payload);
        inbox.cv.notify_all();
    };
    inbox.mark_gone(peer, why);
    if let Some(ring) = outgoing {
        ring.wake();
    }
}

/// Why a stream failed after `got` of a frame's `len` bytes.
fn mid_frame(e: &io::Error, got: usize, len: usize) -> String {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        format!("its connection closed in the middle of a frame ({got} of {len} bytes)")
    } else {
        format!("its connection failed: {e}")
    }
}

/// An empty buffer with room for `len` bytes: a pooled one when `len` is large enough.
fn empty_buffer(len: usize, inbox: &Inbox) -> std::result::Result<Vec<u8>, String> {
    if let Some(b) = if len >= POOLED_MIN { inbox.pool().get_empty(len) } else { None } {
        return Ok(b);
    }
    let mut payload = Vec::new();
    payload
        .try_reserve_exact(len)
        .map_err(|e| format!("a frame of {len} bytes does not fit in memory: {e}"))?;
    Ok(payload)
}

/// Reads a payload of `len` bytes that follows its header on the socket.
fn read_payload(
    s: &mut TcpStream,
    len: usize,
    inbox: &Inbox,
) -> std::result::Result<Vec<u8>, String> {
    if let Some(mut payload) = if len >= POOLED_MIN { inbox.pool().get(len) } else { None } {
        return s.read_exact(&mut payload).map(|()| payload).map_err(|e| mid_frame(&e, 0, len));
    }
    let mut payload = empty_buffer(len, inbox)?;
    match s.take(len as u64).read_to_end(&mut payload) {
        Ok(n) if n == len => Ok(payload),
        Ok(n) => {
            Err(format!("its connection closed in the middle of a frame ({n} of {len} bytes)"))
        }
        Err(e) => Err(mid_frame(&e, payload.len(), len)),
    }
}

impl Incoming {
    /// Receives a payload of `len` bytes through the ring: for each chunk, reads its
    /// notice from the socket, copies the chunk out of its slot and frees the slot.
    fn receive(
        &mut self,
        s: &mut TcpStream,
        len: usize,
        inbox: &Inbox,
    ) -> std::result::Result<Vec<u8>, String> {
        let mut payload = empty_buffer(len, inbox)?;
        while payload.len() < len {
            let want = (len - payload.len()).min(self.ring.slot_bytes());
            let mut note = [0u8; NOTE_LEN];
            s.read_exact(&mut note).map_err(|e| mid_frame(&e, payload.len(), len))?;
            let magic = u32::from_le_bytes([note[0], note[1], note[2], note[3]]);
            let n = u32::from_le_bytes([note[4], note[5], note[6], note[7]]);
            if magic != NOTE_MAGIC || usize::try_from(n).ok() != Some(want) {
                return Err(format!(
                    "it sent a malformed shared-memory notice {note:02x?} (expected one of {want} bytes)"
                ));
            }
            let ahead = self.ring.produced().wrapping_sub(self.got);
            if ahead == 0 || ahead > self.ring.slots() {
                return Err(format!(
                    "it announced a shared-memory chunk it had not written ({ahead} ahead)"
                ));
            }
            self.ring.drain(self.got, want, &mut payload);
            self.got = self.got.wrapping_add(1);
            self.ring.set_consumed(self.got);
        }
        Ok(payload)
    }
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
