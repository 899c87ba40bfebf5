//! The on-disk format (see docs/CHECKPOINT.md): one `metadata.json` per checkpoint and
//! one safetensors file per rank that wrote chunks; tensor bytes and checksums.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use half::{bf16, f16};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use tpar_tensor::{DType, Device, Tensor};

use crate::{CheckpointError, Result};

/// The `format` field of every metadata file.
pub const FORMAT: &str = "tpar-checkpoint";
/// The format version this build writes. Version 2 adds the metadata's own checksum
/// ([`Metadata::checksum`]) and the step of a [`crate::CheckpointManager`]'s
/// checkpoint; version 1 files (no checksum) are still read.
pub const VERSION: u32 = 2;
/// The metadata file's name inside a checkpoint directory.
pub const METADATA: &str = "metadata.json";

/// A checkpoint's `metadata.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    /// Always [`FORMAT`].
    pub format: String,
    /// The format version ([`VERSION`]).
    pub version: u32,
    /// Ranks of the group that saved it.
    pub world_size: usize,
    /// Every tensor by key: global shape, dtype and where each chunk is.
    pub tensors: BTreeMap<String, TensorMeta>,
    /// Every scalar by key.
    pub values: BTreeMap<String, Scalar>,
    /// The training step of a checkpoint a [`crate::CheckpointManager`] saved (checked
    /// against the directory's name when it is loaded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// CRC-32 of the file's canonical form without this field (see
    /// [`Metadata::to_json`]): every value a load reads, scalars included, is covered.
    /// Required from version 2 on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<u32>,
}

impl Metadata {
    /// The CRC-32 of this metadata's canonical JSON (pretty-printed, keys in order,
    /// without `checksum`).
    pub fn compute_checksum(&self) -> Result<u32> {
        let unsummed = Metadata { checksum: None, ..self.clone() };
        let json = serde_json::to_vec_pretty(&unsummed)
            .map_err(|e| CheckpointError::Format { path: METADATA.into(), what: e.to_string() })?;
        Ok(crc32(&json))
    }

    /// The file's bytes: the canonical JSON with the checksum filled in.
    pub fn to_json(&self) -> Result<Vec<u8>> {
        let summed = Metadata { checksum: Some(self.compute_checksum()?), ..self.clone() };
        serde_json::to_vec_pretty(&summed)
            .map_err(|e| CheckpointError::Format { path: METADATA.into(), what: e.to_string() })
    }

    /// Parses a metadata file's bytes and checks its format, version and checksum;
    /// `path` names the file in errors.
    ///
    /// # Errors
    /// [`CheckpointError::Damaged`] for bytes that are not a metadata file or whose
    /// checksum does not match (the file was changed after it was written);
    /// [`CheckpointError::Format`] for another format or version.
    pub fn from_json(bytes: &[u8], path: &Path) -> Result<Metadata> {
        let damaged =
            |what: String| CheckpointError::Damaged { path: path.display().to_string(), what };
        let meta: Metadata = serde_json::from_slice(bytes)
            .map_err(|e| damaged(format!("not a readable metadata file: {e}")))?;
        if meta.format != FORMAT || !(1..=VERSION).contains(&meta.version) {
            return Err(CheckpointError::Format {
                path: path.display().to_string(),
                what: format!(
                    "format {:?} version {}, this build reads {FORMAT:?} versions 1 to {VERSION}",
                    meta.format, meta.version
                ),
            });
        }
        match (meta.version, meta.checksum) {
            (1, None) => {}
            (1, Some(_)) => {
                return Err(damaged(
                    "a version 1 file with a checksum: its version was changed".into(),
                ))
            }
            (_, None) => {
                return Err(damaged(format!("version {} without a checksum", meta.version)))
            }
            (_, Some(saved)) => {
                let sum = meta.compute_checksum()?;
                if sum != saved {
                    return Err(damaged(format!(
                        "checksum {sum:08x}, recorded {saved:08x}: the file was changed after it was written"
                    )));
                }
            }
        }
        Ok(meta)
    }
}

/// One tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Element type: `f32`, `f64`, `bf16`, `f16` or `i64`.
    pub dtype: String,
    /// The global shape.
    pub shape: Vec<usize>,
    /// The chunks that together cover the tensor exactly once.
    pub chunks: Vec<ChunkMeta>,
}

/// Where one chunk of a tensor is stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkMeta {
    /// Where the box starts, per dim.
    pub offsets: Vec<usize>,
    /// The box's size, per dim.
    pub sizes: Vec<usize>,
    /// The safetensors file holding it (relative to the checkpoint directory).
    pub file: String,
    /// The tensor's name in that file.
    pub name: String,
    /// Byte offset of its data in the file.
    pub byte_offset: u64,
    /// Bytes of data (elements x element size, little-endian).
    pub byte_len: u64,
    /// CRC-32 of those bytes.
    pub crc32: u32,
}

/// A scalar value of a state dict.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scalar {
    /// An integer.
    Int(i64),
    /// A finite float (JSON keeps every finite f64 exactly).
    Float(f64),
    /// Any float by its IEEE bits (NaN and infinities, which JSON has no number for).
    FloatBits(u64),
    /// Text.
    Text(String),
}

impl Scalar {
    /// A float as [`Scalar::Float`] when finite, else [`Scalar::FloatBits`].
    pub fn float(v: f64) -> Scalar {
        if v.is_finite() {
            Scalar::Float(v)
        } else {
            Scalar::FloatBits(v.to_bits())
        }
    }
}

/// The dtype named `s` in metadata.
pub(crate) fn dtype_of(s: &str) -> Option<DType> {
    Some(match s {
        "f32" => DType::F32,
        "f64" => DType::F64,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "i64" => DType::I64,
        _ => return None,
    })
}

/// The safetensors dtype of `d`.
pub(crate) fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::I64 => Dtype::I64,
    }
}

/// The tensor dtype of a safetensors dtype, if tpar has it.
pub(crate) fn from_st_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::I64 => DType::I64,
        _ => return None,
    })
}

/// The little-endian bytes of `t`'s elements (copied to the host if needed).
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = if t.device() == Device::Cpu { t.clone() } else { t.to_device(Device::Cpu)? };
    Ok(match t.dtype() {
        DType::F32 => t.with_data::<f32, _>(|s| bytemuck::cast_slice(s).to_vec())?,
        DType::F64 => t.with_data::<f64, _>(|s| bytemuck::cast_slice(s).to_vec())?,
        DType::BF16 => t.with_data::<bf16, _>(|s| bytemuck::cast_slice(s).to_vec())?,
        DType::F16 => t.with_data::<f16, _>(|s| bytemuck::cast_slice(s).to_vec())?,
        DType::I64 => t.with_data::<i64, _>(|s| bytemuck::cast_slice(s).to_vec())?,
    })
}

/// A host tensor of `dtype` and `shape` from little-endian `bytes` (exactly the right
/// number of them).
pub(crate) fn tensor_from_bytes(bytes: &[u8], dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    if bytes.len() != n * dtype.size_in_bytes() {
        return Err(CheckpointError::Format {
            path: String::new(),
            what: format!("{} bytes for {n} elements of {dtype}", bytes.len()),
        });
    }
    Ok(match dtype {
        DType::F32 => Tensor::from_vec(bytemuck::pod_collect_to_vec::<u8, f32>(bytes), shape)?,
        DType::F64 => Tensor::from_vec(bytemuck::pod_collect_to_vec::<u8, f64>(bytes), shape)?,
        DType::BF16 => Tensor::from_vec(bytemuck::pod_collect_to_vec::<u8, bf16>(bytes), shape)?,
        DType::F16 => Tensor::from_vec(bytemuck::pod_collect_to_vec::<u8, f16>(bytes), shape)?,
        DType::I64 => Tensor::from_vec(bytemuck::pod_collect_to_vec::<u8, i64>(bytes), shape)?,
    })
}

/// One tensor for `safetensors::serialize_to_file`.
pub(crate) struct RawView {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl safetensors::View for &RawView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Where each tensor's bytes are in the safetensors file at `path`: name to
/// `(absolute byte offset, byte length)`, from the file's header (an 8-byte
/// little-endian length, then that many bytes of JSON whose entries carry
/// `data_offsets` relative to the end of the header).
pub(crate) fn data_offsets(path: &Path) -> Result<BTreeMap<String, (u64, u64)>> {
    let io = |e: std::io::Error| CheckpointError::io(path, e);
    let mut f = File::open(path).map_err(io)?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(io)?;
    let n = u64::from_le_bytes(n);
    if n > 100 << 20 {
        return Err(CheckpointError::Format {
            path: path.display().to_string(),
            what: format!("safetensors header of {n} bytes"),
        });
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(io)?;
    let bad = |what: String| CheckpointError::Format { path: path.display().to_string(), what };
    let json: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| bad(format!("safetensors header: {e}")))?;
    let obj = json.as_object().ok_or_else(|| bad("safetensors header is not an object".into()))?;
    let mut out = BTreeMap::new();
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let offs = info
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .and_then(|a| Some((a.first()?.as_u64()?, a.get(1)?.as_u64()?)))
            .ok_or_else(|| bad(format!("tensor {name:?} has no data_offsets")))?;
        out.insert(name.clone(), (8 + n + offs.0, offs.1 - offs.0));
    }
    Ok(out)
}

/// Reads `len` bytes at `offset` of `path`.
pub(crate) fn read_at(path: &Path, offset: u64, len: u64) -> std::io::Result<Vec<u8>> {
    let mut f = File::open(path)?;
    f.seek(SeekFrom::Start(offset))?;
    let mut buf = vec![0u8; len as usize];
    f.read_exact(&mut buf)?;
    Ok(buf)
}

/// CRC-32 of `bytes`.
pub(crate) fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}
