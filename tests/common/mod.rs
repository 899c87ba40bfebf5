//! Helpers shared by the root integration tests.
#![allow(dead_code)]

pub mod golden;
pub mod llama_pipeline;
