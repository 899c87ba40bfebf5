//! Helpers shared by the root integration tests.
#![allow(dead_code)]

pub mod examples;
pub mod golden;
pub mod llama_pipeline;
