//! Rate Limit Quota Service (RLQS) state: which Envoys report which bucket,
//! and how each global bucket is split between them ([`allocation`], pure).

pub mod allocation;
