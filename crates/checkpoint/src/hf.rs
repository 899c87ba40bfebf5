//! Safetensors checkpoints in the Hugging Face layout: one `model.safetensors`, or
//! shards `model-0000i-of-0000N.safetensors` named by `model.safetensors.index.json`.
//! Reading takes only the headers up front; each tensor box is read by its byte ranges,
//! so a rank reads only the bytes of the chunks it holds. Writing splits tensors into
//! shards of at most a given size, as `save_pretrained(max_shard_size=...)` does.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorInfo;
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use tpar_tensor::{DType, Device, Tensor};

use crate::format::{from_st_dtype, st_dtype, tensor_bytes, tensor_from_bytes, RawView};
use crate::{CheckpointError, Result};

/// The file name of a checkpoint in one safetensors file.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The file name of the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Headers larger than this are refused (the safetensors crate's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// One tensor of a [`SafetensorsDir`]: its file, dtype, shape and where its bytes are.
#[derive(Clone, Debug)]
pub struct SafetensorsEntry {
    /// The file that holds it.
    pub file: PathBuf,
    /// Its dtype in the file.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Absolute byte offset of its first element in `file`.
    offset: u64,
}

impl SafetensorsEntry {
    /// Its dtype as a tpar dtype (`None` for a dtype tpar does not have).
    pub fn tpar_dtype(&self) -> Option<DType> {
        from_st_dtype(self.dtype)
    }
}

/// The index file's contents.
#[derive(Serialize, Deserialize)]
struct Index {
    #[serde(default)]
    metadata: BTreeMap<String, serde_json::Value>,
    weight_map: BTreeMap<String, String>,
}

/// A Hugging Face safetensors checkpoint directory, opened: every tensor's file, dtype,
/// shape and byte offset, from the files' headers (no tensor data is read by
/// [`SafetensorsDir::open`]).
#[derive(Clone, Debug)]
pub struct SafetensorsDir {
    source: PathBuf,
    tensors: BTreeMap<String, SafetensorsEntry>,
}

impl SafetensorsDir {
    /// Opens `dir`: its `model.safetensors.index.json` and the shards it names, else its
    /// `model.safetensors`.
    ///
    /// # Errors
    /// [`CheckpointError::NotFound`] when `dir` has neither file;
    /// [`CheckpointError::Io`] and [`CheckpointError::Format`] naming the file that
    /// cannot be read or is not safetensors (a header that does not fit the file, an
    /// index naming a tensor its shard lacks).
    pub fn open(dir: &Path) -> Result<SafetensorsDir> {
        let index = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        if index.is_file() {
            let text = fs::read_to_string(&index).map_err(|e| CheckpointError::io(&index, e))?;
            let idx: Index = serde_json::from_str(&text).map_err(|e| CheckpointError::Format {
                path: index.display().to_string(),
                what: format!("not a safetensors index: {e}"),
            })?;
            let mut headers: HashMap<String, BTreeMap<String, SafetensorsEntry>> = HashMap::new();
            let mut tensors = BTreeMap::new();
            for (name, file) in idx.weight_map {
                if !headers.contains_key(&file) {
                    let path = dir.join(&file);
                    headers.insert(file.clone(), read_header(&path)?);
                }
                let entry =
                    headers[&file].get(&name).cloned().ok_or_else(|| CheckpointError::Format {
                        path: dir.join(&file).display().to_string(),
                        what: format!(
                            "{INDEX_FILE} places tensor {name:?} here, but it is not in the file"
                        ),
                    })?;
                tensors.insert(name, entry);
            }
            Ok(SafetensorsDir { source: index, tensors })
        } else if single.is_file() {
            let tensors = read_header(&single)?;
            Ok(SafetensorsDir { source: single, tensors })
        } else {
            Err(CheckpointError::NotFound {
                path: format!("{} (neither {INDEX_FILE} nor {SINGLE_FILE})", dir.display()),
            })
        }
    }

    /// The file that lists the tensors: the index of a sharded checkpoint, or the single
    /// file (what an error about a missing tensor names).
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The tensor named `name`, if the checkpoint has it.
    pub fn get(&self, name: &str) -> Option<&SafetensorsEntry> {
        self.tensors.get(name)
    }

    /// Every tensor, by name.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &SafetensorsEntry)> {
        self.tensors.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The box of tensor `name` at `offsets` of size `sizes`, as a host tensor of the
    /// file's dtype, reading only the byte ranges of that box (one read per contiguous
    /// run of it).
    ///
    /// # Errors
    /// [`CheckpointError::Format`] naming the file and tensor for an unknown name, a dtype
    /// tpar does not have, or a box that reaches past the tensor;
    /// [`CheckpointError::Io`] for the read.
    pub fn read_box(&self, name: &str, offsets: &[usize], sizes: &[usize]) -> Result<Tensor> {
        let e = self.tensors.get(name).ok_or_else(|| CheckpointError::Format {
            path: self.source.display().to_string(),
            what: format!("no tensor {name:?}"),
        })?;
        let bad = |what: String| CheckpointError::Format {
            path: e.file.display().to_string(),
            what: format!("tensor {name:?}: {what}"),
        };
        let dtype = e
            .tpar_dtype()
            .ok_or_else(|| bad(format!("dtype {:?}, which tpar does not have", e.dtype)))?;
        let shape = &e.shape;
        let fits = offsets.len() == shape.len()
            && sizes.len() == shape.len()
            && offsets.iter().zip(sizes).zip(shape).all(|((o, s), n)| o + s <= *n);
        if !fits {
            return Err(bad(format!(
                "a box of size {sizes:?} at {offsets:?} does not fit its shape {shape:?}"
            )));
        }
        let numel: usize = sizes.iter().product();
        if numel == 0 {
            return Ok(Tensor::zeros(sizes, dtype, Device::Cpu)?);
        }
        let es = dtype.size_in_bytes();
        let r = shape.len();
        let mut buf = vec![0u8; numel * es];
        if r == 0 {
            read_exact_at(&e.file, e.offset, &mut buf)?;
            return tensor_from_bytes(&buf, dtype, sizes);
        }
        // Dims from `full` on are whole in the box; dim `c` is the last one a contiguous
        // run spans partly, so a run is sizes[c] * prod(shape[c+1..]) elements.
        let mut full = r;
        while full > 0 && sizes[full - 1] == shape[full - 1] {
            full -= 1;
        }
        let c = full.saturating_sub(1);
        let mut strides = vec![1usize; r];
        for d in (0..r - 1).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        let run = sizes[c] * strides[c];
        let runs: usize = sizes[..c].iter().product();
        let mut f = File::open(&e.file).map_err(|err| CheckpointError::io(&e.file, err))?;
        let mut idx = vec![0usize; c];
        for k in 0..runs {
            let start: usize = (0..c).map(|d| (offsets[d] + idx[d]) * strides[d]).sum::<usize>()
                + offsets[c] * strides[c];
            let pos = e.offset + (start * es) as u64;
            f.seek(SeekFrom::Start(pos)).map_err(|err| CheckpointError::io(&e.file, err))?;
            f.read_exact(&mut buf[k * run * es..(k + 1) * run * es])
                .map_err(|err| CheckpointError::io(&e.file, err))?;
            for d in (0..c).rev() {
                idx[d] += 1;
                if idx[d] < sizes[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        tensor_from_bytes(&buf, dtype, sizes)
    }
}

/// Reads `buf.len()` bytes at `offset` of `path`.
fn read_exact_at(path: &Path, offset: u64, buf: &mut [u8]) -> Result<()> {
    let mut f = File::open(path).map_err(|e| CheckpointError::io(path, e))?;
    f.seek(SeekFrom::Start(offset)).map_err(|e| CheckpointError::io(path, e))?;
    f.read_exact(buf).map_err(|e| CheckpointError::io(path, e))
}

/// The tensors of one safetensors file from its header, checked against the file's size.
fn read_header(path: &Path) -> Result<BTreeMap<String, SafetensorsEntry>> {
    let io = |e: std::io::Error| CheckpointError::io(path, e);
    let bad = |what: String| CheckpointError::Format { path: path.display().to_string(), what };
    let mut f = File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > len {
        return Err(bad(format!("safetensors header of {n} bytes in a file of {len}")));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(io)?;
    let json: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("safetensors header: {e}")))?;
    let data_len = len - 8 - n;
    let mut out = BTreeMap::new();
    for (name, info) in json {
        if name == "__metadata__" {
            continue;
        }
        let info: TensorInfo = serde_json::from_value(info)
            .map_err(|e| bad(format!("tensor {name:?} in the header: {e}")))?;
        let (begin, end) = info.data_offsets;
        let numel = info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let bytes = numel.and_then(|n| n.checked_mul(info.dtype.bitsize())).map(|b| b.div_ceil(8));
        if begin > end || end as u64 > data_len || bytes != Some(end - begin) {
            return Err(bad(format!(
                "tensor {name:?} ({:?} {:?}) at bytes {begin}..{end} of {data_len}",
                info.dtype, info.shape
            )));
        }
        out.insert(
            name,
            SafetensorsEntry {
                file: path.to_path_buf(),
                dtype: info.dtype,
                shape: info.shape,
                offset: 8 + n + begin as u64,
            },
        );
    }
    Ok(out)
}

/// Writes `tensors` (in this order) into `dir` as Hugging Face does: one
/// `model.safetensors` when they fit in `max_shard_bytes`, else shards
/// `model-0000i-of-0000N.safetensors` (a new shard starts when the next tensor would
/// take the current one past `max_shard_bytes`; a larger tensor gets a shard of its
/// own) and `model.safetensors.index.json`. Each file carries the metadata
/// `{"format": "pt"}` and is written under a temporary name, then renamed. An index or
/// single file of the other form left in `dir` by an earlier write is removed. Returns
/// the files written.
///
/// # Errors
/// [`CheckpointError::Io`] naming the file.
pub fn write_sharded_safetensors(
    tensors: &[(String, Tensor)],
    dir: &Path,
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>> {
    fs::create_dir_all(dir).map_err(|e| CheckpointError::io(dir, e))?;
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    let mut total = 0u64;
    for (i, (_, t)) in tensors.iter().enumerate() {
        let bytes = (t.numel() * t.dtype().size_in_bytes()) as u64;
        total += bytes;
        let last = shards.last_mut().expect("one shard");
        if !last.is_empty() && size + bytes > max_shard_bytes {
            shards.push(vec![i]);
            size = bytes;
        } else {
            last.push(i);
            size += bytes;
        }
    }
    let n = shards.len();
    let names: Vec<String> = if n == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=n).map(|i| format!("model-{i:05}-of-{n:05}.safetensors")).collect()
    };
    let mut written = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (file, idx) in names.iter().zip(&shards) {
        let views = idx
            .iter()
            .map(|&i| {
                let (k, t) = &tensors[i];
                weight_map.insert(k.clone(), file.clone());
                let v = RawView {
                    dtype: st_dtype(t.dtype()),
                    shape: t.dims().to_vec(),
                    data: tensor_bytes(t)?,
                };
                Ok((k.clone(), v))
            })
            .collect::<Result<Vec<_>>>()?;
        let path = dir.join(file);
        let tmp = dir.join(format!("{file}.tmp"));
        let refs: Vec<(&str, &RawView)> = views.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(refs, Some(meta), &tmp).map_err(|e| {
            CheckpointError::Io { path: tmp.display().to_string(), what: e.to_string() }
        })?;
        fs::rename(&tmp, &path).map_err(|e| CheckpointError::io(&path, e))?;
        written.push(path);
    }
    let (stale, index) =
        (dir.join(if n == 1 { INDEX_FILE } else { SINGLE_FILE }), dir.join(INDEX_FILE));
    if stale.is_file() {
        fs::remove_file(&stale).map_err(|e| CheckpointError::io(&stale, e))?;
    }
    if n > 1 {
        let idx = Index {
            metadata: BTreeMap::from([("total_size".to_string(), total.into())]),
            weight_map,
        };
        let text = serde_json::to_string_pretty(&idx).map_err(|e| CheckpointError::Format {
            path: index.display().to_string(),
            what: e.to_string(),
        })?;
        let tmp = dir.join(format!("{INDEX_FILE}.tmp"));
        fs::write(&tmp, text + "\n").map_err(|e| CheckpointError::io(&tmp, e))?;
        fs::rename(&tmp, &index).map_err(|e| CheckpointError::io(&index, e))?;
        written.push(index);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tpar-hfst-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    /// `t[offsets .. offsets + sizes]`, by narrowing the whole tensor.
    fn narrowed(t: &Tensor, offsets: &[usize], sizes: &[usize]) -> Vec<f64> {
        let mut t = t.clone();
        for d in 0..sizes.len() {
            t = t.narrow(d as isize, offsets[d], sizes[d]).unwrap();
        }
        t.to_vec_f64().unwrap()
    }

    #[test]
    fn every_box_reads_what_narrowing_the_whole_tensor_gives() {
        let dir = tmp("boxes");
        let n = 3 * 4 * 5;
        let a =
            Tensor::from_vec((0..n).map(|i| i as f32 * 0.5 - 7.0).collect::<Vec<_>>(), [3, 4, 5])
                .unwrap();
        let b = Tensor::from_vec((0..6).map(|i| i as f64).collect::<Vec<_>>(), [6]).unwrap();
        let c = Tensor::from_vec(vec![2.5f32], [1, 1]).unwrap().reshape([]).unwrap();
        let tensors = vec![("a".to_string(), a.clone()), ("b".into(), b.clone()), ("c".into(), c)];
        write_sharded_safetensors(&tensors, &dir, 1 << 20).unwrap();
        let st = SafetensorsDir::open(&dir).unwrap();
        assert!(st.source().ends_with(SINGLE_FILE));
        // Every box of `a` (all offsets and sizes), each dim whole, partial or empty.
        for o0 in 0..3 {
            for s0 in 0..=3 - o0 {
                for o1 in 0..4 {
                    for s1 in 0..=4 - o1 {
                        for (o2, s2) in [(0, 5), (1, 3), (4, 1), (2, 0)] {
                            let (off, size) = ([o0, o1, o2], [s0, s1, s2]);
                            let got = st.read_box("a", &off, &size).unwrap();
                            assert_eq!(got.dims(), size);
                            assert_eq!(got.to_vec_f64().unwrap(), narrowed(&a, &off, &size));
                        }
                    }
                }
            }
        }
        let got = st.read_box("b", &[2], &[3]).unwrap();
        assert_eq!((got.dtype(), got.to_vec_f64().unwrap()), (DType::F64, vec![2.0, 3.0, 4.0]));
        assert_eq!(st.read_box("c", &[], &[]).unwrap().to_vec_f64().unwrap(), vec![2.5]);
        // A box past the tensor and an unknown name are errors naming the file.
        let e = st.read_box("a", &[2, 0, 0], &[2, 4, 5]).unwrap_err().to_string();
        assert!(e.contains(SINGLE_FILE) && e.contains("\"a\""), "{e}");
        assert!(st.read_box("z", &[0], &[1]).is_err());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn shards_split_at_the_size_and_the_index_names_each_tensors_file() {
        let dir = tmp("shards");
        let t = |n: usize| Tensor::from_vec(vec![1.0f32; n], [n]).unwrap();
        // 400, 400, 800 (a shard of its own), 40 bytes; shards of at most 800 bytes.
        let tensors: Vec<(String, Tensor)> =
            [100, 100, 200, 10].iter().enumerate().map(|(i, &n)| (format!("t{i}"), t(n))).collect();
        // A single file of an earlier write is replaced by the shards.
        write_sharded_safetensors(&tensors, &dir, 1 << 20).unwrap();
        assert!(dir.join(SINGLE_FILE).is_file());
        let files = write_sharded_safetensors(&tensors, &dir, 800).unwrap();
        assert!(!dir.join(SINGLE_FILE).exists());
        let names: Vec<String> =
            files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(
            names,
            [
                "model-00001-of-00003.safetensors",
                "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors",
                INDEX_FILE
            ]
        );
        let st = SafetensorsDir::open(&dir).unwrap();
        let file_of = |k: &str| st.get(k).unwrap().file.file_name().unwrap().to_owned();
        assert_eq!(file_of("t0"), file_of("t1"));
        assert_ne!(file_of("t1"), file_of("t2"));
        assert_ne!(file_of("t2"), file_of("t3"));
        let idx: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap();
        assert_eq!(idx["metadata"]["total_size"], 1640);
        // An index naming a tensor its shard lacks is an error naming the shard.
        let text = fs::read_to_string(dir.join(INDEX_FILE)).unwrap();
        fs::write(dir.join(INDEX_FILE), text.replace("\"t3\"", "\"t9\"")).unwrap();
        let e = SafetensorsDir::open(&dir).unwrap_err().to_string();
        assert!(e.contains("model-00003-of-00003.safetensors") && e.contains("t9"), "{e}");
        let _ = fs::remove_dir_all(&dir);
    }
}
