//! Launch wrappers for `cuda/sdpa_hopper.cu`, the Hopper (sm_90a) attention
//! forward pass.
