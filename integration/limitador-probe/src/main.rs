//! `limitador-probe REDIS_URL CALLS`: CALLS decisions, one after another,
//! through Limitador's `AsyncRateLimiter` on its `AsyncRedisStorage` (what
//! limitador-server runs with `redis <URL>`): one limit of 10^9 an hour on
//! one hot descriptor value, every call admitted. Prints the calls made.

use std::collections::HashMap;

use limitador::limit::{Context, Expression, Limit};
use limitador::storage::redis::AsyncRedisStorage;
use limitador::AsyncRateLimiter;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().ok_or("usage: limitador-probe REDIS_URL CALLS")?;
    let calls: u64 = args.next().ok_or("usage: limitador-probe REDIS_URL CALLS")?.parse()?;
    let storage = AsyncRedisStorage::new(&url).await?;
    let limiter = AsyncRateLimiter::new_with_storage(Box::new(storage));
    let variable = Expression::parse("key")?;
    limiter.add_limit(Limit::new("bench", 1_000_000_000, 3600, [], [variable]));
    let namespace = "bench".into();
    let values = HashMap::from([("key".to_string(), "hot".to_string())]);
    let ctx = Context::from(values);
    let mut limited = 0u64;
    for _ in 0..calls {
        let result = limiter
            .check_rate_limited_and_update(&namespace, &ctx, 1)
            .await?;
        if result.limited {
            limited += 1;
        }
    }
    println!("{calls} calls, {limited} limited");
    Ok(())
}
