//! A reader of TensorBoard event files written independently of tpar's writer: its own
//! bitwise CRC-32C, TFRecord framing and protobuf decoding of `Event`, `Summary` and
//! `Summary.Value` (the fields tpar writes). Shared by the metrics tests through
//! `#[path]`.
#![allow(dead_code)]

use std::collections::BTreeMap;

/// CRC-32C, bit by bit (reflected polynomial 0x82F63B78).
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

/// TFRecord's masked CRC, spelled as TensorFlow's `crc32c::Mask` does.
#[allow(clippy::manual_rotate)]
pub fn masked(data: &[u8]) -> u32 {
    let c = crc32c(data);
    ((c >> 15) | (c << 17)).wrapping_add(0xa282_ead8)
}

/// The records of a TFRecord file, each CRC checked.
pub fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
        assert_eq!(len_crc, masked(len_bytes), "length CRC of the record at byte {at}");
        let data = &bytes[at + 12..at + 12 + len];
        let data_crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
        assert_eq!(data_crc, masked(data), "data CRC of the record at byte {at}");
        out.push(data.to_vec());
        at += 16 + len;
    }
    assert_eq!(at, bytes.len());
    out
}

fn varint(b: &[u8], at: &mut usize) -> u64 {
    let mut v = 0u64;
    let mut shift = 0;
    loop {
        let byte = b[*at];
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return v;
        }
        shift += 7;
    }
}

/// Protobuf fields: (field number, wire type, payload as bytes or the varint's value).
enum Field {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(Vec<u8>),
}

fn fields(b: &[u8]) -> Vec<(u64, Field)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < b.len() {
        let key = varint(b, &mut at);
        let f = match key & 7 {
            0 => Field::Varint(varint(b, &mut at)),
            1 => {
                at += 8;
                Field::Fixed64(b[at - 8..at].try_into().unwrap())
            }
            2 => {
                let n = varint(b, &mut at) as usize;
                at += n;
                Field::Bytes(b[at - n..at].to_vec())
            }
            5 => {
                at += 4;
                Field::Fixed32(b[at - 4..at].try_into().unwrap())
            }
            w => panic!("wire type {w}"),
        };
        out.push((key >> 3, f));
    }
    out
}

/// A decoded Event: wall time, step, file version, scalars by tag.
#[derive(Debug, Default)]
pub struct Event {
    pub wall_time: f64,
    pub step: i64,
    pub file_version: Option<String>,
    pub scalars: BTreeMap<String, f32>,
}

pub fn event(b: &[u8]) -> Event {
    let mut e = Event::default();
    for (n, f) in fields(b) {
        match (n, f) {
            (1, Field::Fixed64(x)) => e.wall_time = f64::from_le_bytes(x),
            (2, Field::Varint(x)) => e.step = x as i64,
            (3, Field::Bytes(s)) => e.file_version = Some(String::from_utf8(s).unwrap()),
            (5, Field::Bytes(summary)) => {
                for (n, v) in fields(&summary) {
                    let (1, Field::Bytes(value)) = (n, v) else { panic!("Summary field {n}") };
                    let (mut tag, mut val) = (None, None);
                    for (n, f) in fields(&value) {
                        match (n, f) {
                            (1, Field::Bytes(t)) => tag = Some(String::from_utf8(t).unwrap()),
                            (2, Field::Fixed32(x)) => val = Some(f32::from_le_bytes(x)),
                            (n, _) => panic!("Value field {n}"),
                        }
                    }
                    e.scalars.insert(tag.unwrap(), val.unwrap());
                }
            }
            (n, _) => panic!("Event field {n}"),
        }
    }
    e
}

/// The events of an event file, every record's CRCs checked.
pub fn read_events(path: &std::path::Path) -> Vec<Event> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    records(&bytes).iter().map(|r| event(r)).collect()
}
