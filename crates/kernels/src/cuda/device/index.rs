//! Which embedded source defines which kernel: the names in each source's
//! `TPAR_KERNEL(<name>, ...)` lines ([`kernel_names`]), and the index from a
//! kernel name to its source ([`source_of`]) that a first launch compiles.

use std::collections::HashMap;
use std::sync::OnceLock;

use crate::cuda::KernelSource;

/// The kernel names a source defines: the first argument of each
/// `TPAR_KERNEL(<name>, ...)` outside `//` comments, in order.
pub fn kernel_names(text: &str) -> Vec<&str> {
    const MACRO: &str = "TPAR_KERNEL(";
    let mut out = Vec::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find(MACRO) {
            let before_ok = rest[..at]
                .chars()
                .next_back()
                .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
            let after = &rest[at + MACRO.len()..];
            rest = after;
            if !before_ok {
                continue;
            }
            let after = after.trim_start();
            let end = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            let (name, tail) = after.split_at(end);
            if !name.is_empty() && tail.trim_start().starts_with(',') {
                out.push(name);
            }
        }
    }
    out
}

/// The embedded source that defines `kernel`, if any.
pub fn source_of(kernel: &str) -> Option<&'static KernelSource> {
    static INDEX: OnceLock<HashMap<&'static str, &'static KernelSource>> = OnceLock::new();
    INDEX
        .get_or_init(|| {
            let mut index = HashMap::new();
            for src in crate::cuda::sources() {
                for name in kernel_names(src.text) {
                    index.entry(name).or_insert(src);
                }
            }
            index
        })
        .get(kernel)
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_kernel_names() {
        let text = "// TPAR_KERNEL(commented, A, 32)\n\
                    TPAR_KERNEL(tpar_a_f32, Args, 256) { }\n\
                    TPAR_KERNEL( tpar_b_bf16 , Args, 256) {}  TPAR_KERNEL(tpar_c_f16,X,32){}\n\
                    #define MY_TPAR_KERNEL(x, y) x\n\
                    TPAR_KERNEL(not_a_kernel)\n";
        assert_eq!(kernel_names(text), ["tpar_a_f32", "tpar_b_bf16", "tpar_c_f16"]);
    }

    #[test]
    fn every_embedded_kernel_is_indexed() {
        for src in crate::cuda::sources() {
            for name in kernel_names(src.text) {
                assert_eq!(source_of(name).map(|s| s.name), Some(src.name), "{name}");
            }
        }
        assert!(source_of("tpar_no_such_kernel").is_none());
    }
}
