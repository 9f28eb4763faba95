//! Where the rules come from: the watched files (`reload`) and an ADS
//! server's snapshots (`xds`), each validated and swapped in whole through
//! the rules' own loader, with reloads counted in telemetry.
//!
//! **Layer** (docs/architecture.md, "Layers", kept by `tests/layers.rs`):
//! under `store`; uses `telemetry`, the rules themselves and leaves.

pub mod reload;
pub mod xds;
