//! tpar dtensor layer (filled by later work).
#![warn(missing_docs)]
