//! tpar parallel-styles layer (filled by later work).
#![warn(missing_docs)]
