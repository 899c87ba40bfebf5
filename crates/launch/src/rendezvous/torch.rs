//! A client of PyTorch's `TCPStore`: the store torchrun's agent already serves on
//! `MASTER_ADDR:MASTER_PORT` when it sets `TORCHELASTIC_USE_AGENT_STORE=True`.
//!
//! The protocol, as PyTorch's server speaks it (its classic and libuv backends alike):
//! after connecting, the client sends the query byte `VALIDATE` (0) and the magic number
//! `0x3C85F7CE` as a little-endian `u32`, with no reply. Each request is then one query
//! byte followed by its fields; strings and byte vectors are a little-endian `u64`
//! length and the bytes, integers little-endian `i64`:
//!
//! | query | code | fields | reply |
//! |-------|------|--------|-------|
//! | `SET` | 1 | key, value | none |
//! | `GET` | 3 | key | value (the key must exist) |
//! | `ADD` | 4 | key, `i64` delta | the new `i64` value |
//! | `CHECK` | 5 | `u64` count, keys | one byte: 0 all set, 1 not yet |
//!
//! Keys get PyTorch's client prefix `/`, so `store.get("k")` from a Python `TCPStore`
//! client sees what this one sets under `"k"`. Waiting is a `CHECK` poll (with a growing
//! pause up to 50 ms), so every wait has a timeout without PyTorch's `WAIT`/`CANCEL_WAIT`
//! exchange.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use tpar_collectives::{Store, StoreError};

use super::{RendezvousError, Result};

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const MAGIC: u32 = 0x3C85_F7CE;
const READY: u8 = 0;
const NOT_READY: u8 = 1;
/// PyTorch's `TCPStore` clients prefix every key with this.
const KEY_PREFIX: &str = "/";
/// Largest value accepted from the server.
const MAX_VALUE: u64 = 64 << 20;

/// A connection to a PyTorch `TCPStore` server (torchrun's agent store): `set`, `get`,
/// `add`, `check` and `wait`, each bounded by a timeout. It implements the
/// [`Store`](tpar_collectives::Store) trait, so a backend can rendezvous through the
/// agent's store directly; [`EnvInit::store`](crate::EnvInit::store) uses it only to
/// publish where rank 0's own [`TcpStore`](crate::TcpStore) listens.
pub struct TorchStoreClient {
    addr: String,
    conn: Mutex<Option<TcpStream>>,
    timeout: Duration,
    local_addr: Option<SocketAddr>,
}

impl fmt::Debug for TorchStoreClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TorchStoreClient")
            .field("addr", &self.addr)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl TorchStoreClient {
    /// Connects to the PyTorch `TCPStore` at `addr` (`"host:port"`), retrying until
    /// `timeout` (the agent may still be starting), and validates the connection.
    /// `timeout` is the default of [`get`](Self::get) and bounds every request.
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self> {
        let stream = super::client::connect_retrying(addr, timeout)?;
        let _ = stream.set_nodelay(true);
        let local_addr = stream.local_addr().ok();
        let store =
            Self { addr: addr.to_string(), conn: Mutex::new(Some(stream)), timeout, local_addr };
        let mut hello = vec![VALIDATE];
        hello.extend_from_slice(&MAGIC.to_le_bytes());
        store.exchange("connect", &[], &hello, |_| Ok(()))?;
        Ok(store)
    }

    /// The address this client connected to.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// This end of the connection: the local interface that reaches the server.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local_addr
    }

    /// Stores `value` under `key`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut req = vec![SET];
        put_bytes(&mut req, prefixed(key).as_bytes());
        put_bytes(&mut req, value);
        self.exchange("set", &[key], &req, |_| Ok(()))
    }

    /// Whether every key in `keys` is set, without waiting.
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        let mut req = vec![CHECK];
        req.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            put_bytes(&mut req, prefixed(k).as_bytes());
        }
        self.exchange("check", keys, &req, |s| {
            let mut b = [0u8; 1];
            s.read_exact(&mut b)?;
            match b[0] {
                READY => Ok(true),
                NOT_READY => Ok(false),
                other => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unknown CHECK reply {other}"),
                )),
            }
        })
    }

    /// Waits up to `timeout` until every key in `keys` is set.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(1);
        loop {
            if self.check(keys)? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RendezvousError::Timeout {
                    addr: self.addr.clone(),
                    op: "wait",
                    keys: keys.iter().map(|k| k.to_string()).collect(),
                    timeout,
                });
            }
            thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// The value of `key`, waiting up to the client's timeout for it to be set.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        match self.wait(&[key], timeout) {
            Err(RendezvousError::Timeout { addr, keys, timeout, .. }) => {
                return Err(RendezvousError::Timeout { addr, op: "get", keys, timeout })
            }
            r => r?,
        }
        let mut req = vec![GET];
        put_bytes(&mut req, prefixed(key).as_bytes());
        self.exchange("get", &[key], &req, read_bytes)
    }

    /// Adds `delta` to the counter under `key` (absent counts as 0) and returns the new
    /// value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut req = vec![ADD];
        put_bytes(&mut req, prefixed(key).as_bytes());
        req.extend_from_slice(&delta.to_le_bytes());
        self.exchange("add", &[key], &req, |s| {
            let mut b = [0u8; 8];
            s.read_exact(&mut b)?;
            Ok(i64::from_le_bytes(b))
        })
    }

    /// Writes one request and reads its reply with `read`, under the client's timeout.
    /// After an error the connection is closed: it may be out of step with the server.
    fn exchange<T>(
        &self,
        op: &'static str,
        keys: &[&str],
        req: &[u8],
        read: impl FnOnce(&mut TcpStream) -> io::Result<T>,
    ) -> Result<T> {
        let keys_owned = || keys.iter().map(|k| k.to_string()).collect::<Vec<_>>();
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let Some(stream) = guard.as_mut() else {
            return Err(RendezvousError::Closed { addr: self.addr.clone() });
        };
        let t = Some(self.timeout.max(Duration::from_millis(1)));
        let result = stream
            .set_read_timeout(t)
            .and_then(|_| stream.set_write_timeout(t))
            .and_then(|_| stream.write_all(req))
            .and_then(|_| stream.flush())
            .and_then(|_| read(stream));
        result.map_err(|source| {
            if let Some(s) = guard.take() {
                let _ = s.shutdown(Shutdown::Both);
            }
            match source.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => RendezvousError::Timeout {
                    addr: self.addr.clone(),
                    op,
                    keys: keys_owned(),
                    timeout: self.timeout,
                },
                io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe => {
                    RendezvousError::ServerGone { addr: self.addr.clone(), op, keys: keys_owned() }
                }
                io::ErrorKind::InvalidData => RendezvousError::Protocol {
                    addr: self.addr.clone(),
                    what: format!("reply to {op} of {:?}: {source}", keys_owned()),
                },
                _ => {
                    RendezvousError::Io { addr: self.addr.clone(), op, keys: keys_owned(), source }
                }
            }
        })
    }
}

impl Drop for TorchStoreClient {
    fn drop(&mut self) {
        if let Some(s) = self.conn.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn prefixed(key: &str) -> String {
    format!("{KEY_PREFIX}{key}")
}

fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u64).to_le_bytes());
    buf.extend_from_slice(b);
}

fn read_bytes(s: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_VALUE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("value of {len} bytes exceeds the limit of {MAX_VALUE}"),
        ));
    }
    let mut v = vec![0u8; len as usize];
    s.read_exact(&mut v)?;
    Ok(v)
}

impl Store for TorchStoreClient {
    fn set(&self, key: &str, value: &[u8]) -> std::result::Result<(), StoreError> {
        Ok(TorchStoreClient::set(self, key, value)?)
    }

    fn get_timeout(
        &self,
        key: &str,
        timeout: Duration,
    ) -> std::result::Result<Vec<u8>, StoreError> {
        Ok(TorchStoreClient::get_timeout(self, key, timeout)?)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> std::result::Result<(), StoreError> {
        Ok(TorchStoreClient::wait(self, keys, timeout)?)
    }

    fn check(&self, keys: &[&str]) -> std::result::Result<bool, StoreError> {
        Ok(TorchStoreClient::check(self, keys)?)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::net::TcpListener;

    use super::*;

    /// A tiny server of the subset above, as PyTorch's speaks it.
    fn fake_server() -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut map: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
            let u8_ = |s: &mut TcpStream| {
                let mut b = [0u8; 1];
                s.read_exact(&mut b).map(|_| b[0])
            };
            let u64_ = |s: &mut TcpStream| {
                let mut b = [0u8; 8];
                s.read_exact(&mut b).map(|_| u64::from_le_bytes(b))
            };
            let bytes = |s: &mut TcpStream| -> io::Result<Vec<u8>> {
                let n = u64_(s)?;
                let mut v = vec![0; n as usize];
                s.read_exact(&mut v)?;
                Ok(v)
            };
            assert_eq!(u8_(&mut s).unwrap(), VALIDATE);
            let mut m = [0u8; 4];
            s.read_exact(&mut m).unwrap();
            assert_eq!(u32::from_le_bytes(m), MAGIC);
            while let Ok(op) = u8_(&mut s) {
                match op {
                    SET => {
                        let k = bytes(&mut s).unwrap();
                        map.insert(k, bytes(&mut s).unwrap());
                    }
                    GET => {
                        let v = map[&bytes(&mut s).unwrap()].clone();
                        s.write_all(&(v.len() as u64).to_le_bytes()).unwrap();
                        s.write_all(&v).unwrap();
                    }
                    ADD => {
                        let k = bytes(&mut s).unwrap();
                        let d = u64_(&mut s).unwrap() as i64;
                        let old: i64 = map
                            .get(&k)
                            .map(|v| String::from_utf8_lossy(v).parse().unwrap())
                            .unwrap_or(0);
                        map.insert(k, (old + d).to_string().into_bytes());
                        s.write_all(&(old + d).to_le_bytes()).unwrap();
                    }
                    CHECK => {
                        let n = u64_(&mut s).unwrap();
                        let keys: Vec<_> = (0..n).map(|_| bytes(&mut s).unwrap()).collect();
                        let ok = keys.iter().all(|k| map.contains_key(k));
                        s.write_all(&[if ok { READY } else { NOT_READY }]).unwrap();
                    }
                    other => panic!("unexpected op {other}"),
                }
            }
        });
        addr
    }

    #[test]
    fn speaks_pytorchs_tcpstore_protocol() {
        let c = TorchStoreClient::connect(&fake_server(), Duration::from_secs(5)).unwrap();
        assert!(!c.check(&["a"]).unwrap());
        c.set("a", b"hello").unwrap();
        assert!(c.check(&["a"]).unwrap());
        assert_eq!(c.get("a").unwrap(), b"hello");
        assert_eq!(c.add("n", 3).unwrap(), 3);
        assert_eq!(c.add("n", -1).unwrap(), 2);
        let t0 = Instant::now();
        let e = c.get_timeout("missing", Duration::from_millis(200)).unwrap_err();
        assert!(t0.elapsed() >= Duration::from_millis(200));
        assert!(
            matches!(&e, RendezvousError::Timeout { op: "get", keys, .. } if keys == &["missing"]),
            "{e}"
        );
        // Still usable after a timeout of its own making.
        assert_eq!(c.get("a").unwrap(), b"hello");
    }
}
