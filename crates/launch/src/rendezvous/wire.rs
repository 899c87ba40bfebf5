//! The store's wire format: each message is a big-endian `u32` length followed by that
//! many bytes (an op code and its length-prefixed fields; replies start with a status
//! byte).

use std::io::{self, Read, Write};
use std::time::Duration;

pub(super) const MAGIC: &[u8] = b"tpar-store";
pub(super) const VERSION: u32 = 1;
/// Largest message either side accepts (keys and values are small: ids, counters).
pub(super) const MAX_FRAME: usize = 64 << 20;
/// Extra time a client waits for the server's own "timed out" answer.
pub(super) const REPLY_GRACE: Duration = Duration::from_secs(5);
/// How long a dropped server waits for its connection threads to finish replies.
pub(super) const DRAIN: Duration = Duration::from_secs(2);

pub(super) const OP_HELLO: u8 = 0;
pub(super) const OP_SET: u8 = 1;
pub(super) const OP_GET: u8 = 2;
pub(super) const OP_ADD: u8 = 3;
pub(super) const OP_CHECK: u8 = 4;
pub(super) const OP_WAIT: u8 = 5;
pub(super) const OP_BARRIER: u8 = 6;
pub(super) const OP_DELETE: u8 = 7;
/// Registers the connection as a rank of the job: its rank and world size.
pub(super) const OP_JOIN: u8 = 8;
/// The client closes its connection on purpose (its store was dropped): no reply.
pub(super) const OP_BYE: u8 = 9;

pub(super) const ST_OK: u8 = 0;
pub(super) const ST_TIMEOUT: u8 = 1;
/// A malformed request; the server closes the connection after it.
pub(super) const ST_ERROR: u8 = 2;
/// A well-formed request the server refuses; the connection stays usable.
pub(super) const ST_REFUSED: u8 = 3;
/// The job has failed (a rank's process died, or ranks disagree on who is who): a kind
/// ([`FAIL_GONE`] or [`FAIL_MISMATCH`]), the rank concerned and a message.
pub(super) const ST_FAILED: u8 = 4;

/// A joined rank's connection closed without a goodbye: its process is gone.
pub(super) const FAIL_GONE: u8 = 0;
/// Ranks disagree on the world size, or two processes claim one rank.
pub(super) const FAIL_MISMATCH: u8 = 1;

/// Builds one message body.
#[derive(Default)]
pub(super) struct Enc(pub(super) Vec<u8>);

impl Enc {
    pub(super) fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub(super) fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    pub(super) fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    pub(super) fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    pub(super) fn bytes(self, v: &[u8]) -> Self {
        let mut s = self.u32(v.len() as u32);
        s.0.extend_from_slice(v);
        s
    }
    pub(super) fn keys<S: AsRef<str>>(self, keys: &[S]) -> Self {
        keys.iter().fold(self.u32(keys.len() as u32), |e, k| e.bytes(k.as_ref().as_bytes()))
    }
    pub(super) fn millis(self, d: Duration) -> Self {
        self.u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// Reads one message body; every read is bounds-checked.
pub(super) struct Dec<'a>(pub(super) &'a [u8]);

impl<'a> Dec<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
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
    pub(super) fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    pub(super) fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    pub(super) fn i64(&mut self) -> Result<i64, String> {
        Ok(i64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    pub(super) fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub(super) fn string(&mut self) -> Result<String, String> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("key is not UTF-8: {b:?}"))
    }
    pub(super) fn keys(&mut self) -> Result<Vec<String>, String> {
        let n = self.u32()? as usize;
        // Each key needs at least its 4-byte length: refuse counts the body cannot hold.
        if n > self.0.len() / 4 {
            return Err(format!("key count {n} exceeds the message size"));
        }
        (0..n).map(|_| self.string()).collect()
    }
    pub(super) fn millis(&mut self) -> Result<Duration, String> {
        Ok(Duration::from_millis(self.u64()?))
    }
    pub(super) fn end(&self) -> Result<(), String> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(format!("{} unexpected trailing bytes", self.0.len()))
        }
    }
}

pub(super) enum FrameError {
    /// The peer closed the connection cleanly between messages.
    Eof,
    Io(io::Error),
    Malformed(String),
}

pub(super) fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)?;
    w.flush()
}

pub(super) fn read_frame(r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
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
