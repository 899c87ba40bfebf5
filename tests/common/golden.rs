//! Reads the golden files under `tests/golden/` (safetensors written by the PyTorch
//! scripts beside them): every tensor as f64 (or i64) values with its shape.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use safetensors::{Dtype, SafeTensors};

/// One golden tensor: its shape and values (integers widened to f64 exactly when they
/// fit, which every index and token id in these files does).
#[derive(Clone, Debug)]
pub struct Golden {
    /// Shape as written.
    pub shape: Vec<usize>,
    /// Values in row-major order.
    pub values: Vec<f64>,
}

impl Golden {
    /// The values as i64 (for ids and indices).
    pub fn ints(&self) -> Vec<i64> {
        self.values.iter().map(|&v| v as i64).collect()
    }
}

/// The path of a golden file by name (`tests/golden/<name>`).
pub fn path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests").join("golden").join(name)
}

/// Every tensor of the golden file `name`, by key.
pub fn load(name: &str) -> BTreeMap<String, Golden> {
    let p = path(name);
    let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
    let st =
        SafeTensors::deserialize(&bytes).unwrap_or_else(|e| panic!("parsing {}: {e}", p.display()));
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let data = view.data();
        let values: Vec<f64> = match view.dtype() {
            Dtype::F64 => {
                data.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
            }
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            Dtype::I64 => data
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            Dtype::BOOL | Dtype::U8 => data.iter().map(|&b| b as f64).collect(),
            other => panic!("{}: tensor {name} has unsupported dtype {other:?}", p.display()),
        };
        out.insert(name, Golden { shape: view.shape().to_vec(), values });
    }
    out
}

/// The tensor `key` of a loaded file (panics naming the key when absent).
pub fn get<'a>(file: &'a BTreeMap<String, Golden>, key: &str) -> &'a Golden {
    file.get(key).unwrap_or_else(|| {
        panic!("golden key {key} missing; present: {:?}", file.keys().collect::<Vec<_>>())
    })
}

/// Asserts `got` equals `want` elementwise within `atol + rtol * |want|`, naming the
/// worst element.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: {} values, golden has {}", got.len(), want.len());
    let mut worst: Option<(usize, f64)> = None;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        let ok = err <= atol + rtol * w.abs() || (g.is_infinite() && g == w);
        if !ok && worst.is_none_or(|(_, e)| err > e) {
            worst = Some((i, err));
        }
    }
    if let Some((i, err)) = worst {
        panic!(
            "{what}: element {i} is {} but the golden value is {} (|diff| {err:e}, atol {atol:e}, \
             rtol {rtol:e})",
            got[i], want[i]
        );
    }
}
