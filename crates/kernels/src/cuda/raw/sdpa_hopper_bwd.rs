//! Launch wrappers for `cuda/sdpa_hopper_bwd.cu`, the Hopper (sm_90a)
//! attention backward pass.
