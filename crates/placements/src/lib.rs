//! tpar placements layer (filled by later work).
#![warn(missing_docs)]
