#!/usr/bin/env bash
# Compiles the tpar column of docs/PORTING.md (examples/porting.rs) as its own crate
# outside this workspace, depending on tpar by path: what a user's `cargo add tpar`
# project sees (the public API and the prelude only, no workspace-internal paths).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/src"
cp "$root/examples/porting.rs" "$dir/src/main.rs"
cp "$root/Cargo.lock" "$dir/Cargo.lock"
cat > "$dir/Cargo.toml" <<TOML
[package]
name = "porting-outside"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
tpar = { path = "$root" }

[workspace]
TOML
# The workspace's lock file pins the same versions; everything is already fetched.
# The workspace's target directory: the dependencies `cargo clippy` (or `cargo check`)
# checked there are reused, not checked again (a separate directory cost .ci/run
# 95 s of CPU time; sharing it, 14 s).
target="${CARGO_TARGET_DIR:-$root/target}"
case "$target" in /*) ;; *) target="$PWD/$target" ;; esac
(cd "$dir" && CARGO_TARGET_DIR="$target" cargo check --offline --quiet)
echo "check-outside-crate: examples/porting.rs compiles as a crate outside the workspace"
