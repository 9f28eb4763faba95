//! tokenbucket-rls: an Envoy external rate-limit service with token buckets.
//!
//! The request path reads top to bottom: [`service`] (gRPC, request checks,
//! the answer) → [`rules`] (which rule a descriptor reaches) → [`limiter`]
//! (bucket math, decisions, failure policy) → [`store`] (where bucket state
//! lives). [`bucket`], the token-bucket arithmetic that rules, limiter and
//! stores all use, sits at the bottom. [`admin`], [`health`], [`telemetry`]
//! and [`server`] sit beside the path.

pub mod admin;
pub mod attempt;
pub mod background;
pub mod bucket;
pub mod calendar;
pub mod cli;
pub mod clock;
pub mod connection_bounds;
pub mod decision;
pub mod health;
pub mod hitters;
pub mod instances;
pub mod labels;
pub mod limiter;
pub mod pb_struct;
pub mod periodic;
pub mod quota;
pub mod replication;
pub mod rules;
pub mod server;
pub mod service;
pub mod serving;
pub mod shown;
pub mod sources;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod window;
