use super::*;
use fred::bytes::BytesMut;
use redis_protocol::resp2::decode::decode_bytes_mut;
use std::sync::atomic::AtomicU64;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A server that answers every command with `*1 :<n>`, `n` counting
/// from one, and counts the reads that brought commands. With
/// `close_after`, its first connection answers nothing and closes once
/// it has read that many commands; later ones answer.
async fn stand_in(close_after: Option<u64>) -> (u16, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let reads = Arc::new(AtomicU64::new(0));
    let counted = reads.clone();
    tokio::spawn(async move {
        let mut served = 0u64;
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let mut buf = BytesMut::with_capacity(64 * 1024);
            let mut closing = false;
            'conn: loop {
                match socket.read_buf(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                counted.fetch_add(1, Ordering::Relaxed);
                let mut out = Vec::new();
                while let Ok(Some(_)) = decode_bytes_mut(&mut buf) {
                    served += 1;
                    match close_after {
                        // read, never answered; closed once all are in
                        Some(n) => closing = served >= n,
                        None => out.extend_from_slice(format!("*1\r\n:{served}\r\n").as_bytes()),
                    }
                }
                if socket.write_all(&out).await.is_err() {
                    break 'conn;
                }
                if closing {
                    drop(socket);
                    // later connections answer again
                    return serve_forever(listener, served).await;
                }
            }
        }
    });
    (port, reads)
}

async fn serve_forever(listener: TcpListener, mut served: u64) {
    while let Ok((mut socket, _)) = listener.accept().await {
        let mut buf = BytesMut::with_capacity(4096);
        while socket.read_buf(&mut buf).await.is_ok_and(|n| n > 0) {
            let mut out = Vec::new();
            while let Ok(Some(_)) = decode_bytes_mut(&mut buf) {
                served += 1;
                out.extend_from_slice(format!("*1\r\n:{served}\r\n").as_bytes());
            }
            if socket.write_all(&out).await.is_err() {
                break;
            }
        }
    }
}

/// A server that answers every command on every connection, serving
/// them all at once, with `*1 :1`.
async fn answering_everyone() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = BytesMut::with_capacity(4096);
                while socket.read_buf(&mut buf).await.is_ok_and(|n| n > 0) {
                    let mut out = Vec::new();
                    while let Ok(Some(_)) = decode_bytes_mut(&mut buf) {
                        out.extend_from_slice(b"*1\r\n:1\r\n");
                    }
                    if socket.write_all(&out).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}

fn target(port: u16) -> Target {
    Target {
        host: "127.0.0.1".into(),
        port,
        unix: None,
        tls: None,
        username: None,
        password: None,
        credentials: None,
        database: None,
        connect_timeout: Duration::from_secs(2),
    }
}

#[tokio::test(flavor = "current_thread")]
async fn concurrent_calls_share_writes_and_are_answered_in_order() {
    let (port, reads) = stand_in(None).await;
    let pipes = Arc::new(Pipes::connect(&target(port), 1, 0, 1));
    pipes.wait(Duration::from_secs(2)).await;
    assert!(pipes.connected());
    let calls: Vec<_> = (0..200)
        .map(|i| {
            let pipes = pipes.clone();
            tokio::spawn(async move {
                let keys = [Key::from(format!("k{i}"))];
                pipes.eval("sha", "body", &keys, &[]).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for c in calls {
        answers.push(c.await.expect("task").expect("answered")[0]);
    }
    // one connection answers in the order it was written: all distinct,
    // 1..=200
    let mut sorted = answers.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (1..=200).collect::<Vec<i64>>());
    // queued together, written together
    let writes = pipes.writes();
    assert!(writes <= 2, "200 calls took {writes} writes");
    let reads = reads.load(Ordering::Relaxed);
    assert!(reads <= 10, "200 calls reached the server in {reads} reads");
}

/// A call whose caller has gone before it was written (its deadline
/// passed: the failure mode answered) is never written, so it cannot
/// spend: the next call is the server's first command.
#[tokio::test(flavor = "current_thread")]
async fn a_call_whose_caller_is_gone_is_not_written() {
    let (port, _) = stand_in(None).await;
    let pipes = Arc::new(Pipes::connect(&target(port), 1, 0, 1));
    pipes.wait(Duration::from_secs(2)).await;
    let keys = [Key::from("k")];
    // queued, then given up on before the writer's turn
    let mut gone = Box::pin(pipes.eval("sha", "body", &keys, &[]));
    assert!(futures::poll!(&mut gone).is_pending(), "queued");
    drop(gone);
    let answer = pipes
        .eval("sha", "body", &keys, &[])
        .await
        .expect("answered");
    assert_eq!(answer, [1], "the server's first command");
}

#[tokio::test(flavor = "current_thread")]
async fn calls_fill_the_first_connection_and_spill_over_when_it_is_behind() {
    let port = answering_everyone().await;
    let pipes = Arc::new(Pipes::connect(&target(port), 3, 0, 1));
    pipes.wait(Duration::from_secs(2)).await;
    let burst = |n: usize| {
        let calls: Vec<_> = (0..n)
            .map(|_| {
                let pipes = pipes.clone();
                tokio::spawn(async move { pipes.eval("sha", "body", &[], &[]).await })
            })
            .collect();
        async move {
            for c in calls {
                c.await.expect("task").expect("answered");
            }
        }
    };
    // 200 calls at once: all on the first connection
    burst(200).await;
    let writes = pipes.writes_each();
    assert!(writes[0] >= 1 && writes[1..] == [0, 0], "{writes:?}");
    // more at once than SPILL: the first connection's queue is behind
    // when the rest come, so they go to the second
    burst(SPILL + 100).await;
    let writes = pipes.writes_each();
    assert!(writes[1] >= 1 && writes[2] == 0, "{writes:?}");
    // the first connection down: its calls go to the next one up
    pipes.pipes[0].up.store(false, Ordering::Relaxed);
    let before = pipes.writes_each();
    pipes
        .eval("sha", "body", &[], &[])
        .await
        .expect("answered elsewhere");
    let after = pipes.writes_each();
    assert_eq!(after[0], before[0]);
    assert_eq!(after[1], before[1] + 1);
}

/// A serving thread's calls go out on its own connection, made on its
/// runtime at its first call (which, made before that connection is
/// up, goes out on a shared one); a thread without a lane uses the
/// shared ones.
#[test]
fn a_serving_threads_calls_go_out_on_its_own_connection() {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("main runtime");
    let pipes = main.block_on(async {
        let port = answering_everyone().await;
        let pipes = Arc::new(Pipes::connect(&target(port), 2, 1, 1));
        pipes.wait(Duration::from_secs(2)).await;
        pipes
    });
    let on_thread = |index: usize, calls: usize| {
        let pipes = pipes.clone();
        std::thread::spawn(move || {
            crate::background::mark_serving_thread(index);
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("serving runtime");
            runtime.block_on(async move {
                pipes.eval("sha", "body", &[], &[]).await.expect("first");
                let lane_up = || {
                    pipes
                        .lanes
                        .get(index)
                        .and_then(OnceLock::get)
                        .is_some_and(|p| p.up.load(Ordering::Relaxed))
                };
                // connected in the background: up at once on an idle
                // machine, later on a busy one
                let has_lane = index < pipes.lanes.len();
                for _ in 0..1000 {
                    if !has_lane || lane_up() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let shared_before = pipes.writes_each();
                let calls: Vec<_> = (0..calls)
                    .map(|_| {
                        let pipes = pipes.clone();
                        tokio::spawn(async move { pipes.eval("sha", "body", &[], &[]).await })
                    })
                    .collect();
                for c in calls {
                    c.await.expect("task").expect("answered");
                }
                (shared_before, pipes.writes_each())
            })
        })
        .join()
        .expect("serving thread")
    };
    // serving thread 0: its first call on the shared connections, the
    // next 50 in one write (or a few) on its own
    let (before, after) = on_thread(0, 50);
    assert_eq!(
        before[0], 1,
        "the first call went out on a shared connection"
    );
    assert_eq!(
        after, before,
        "later calls stayed off the shared connections"
    );
    let lane = pipes.lane_writes();
    assert!((1..=5).contains(&lane[0]), "{lane:?}");
    // serving thread 3 has no lane (only 1 was made room for)
    let (before, after) = on_thread(3, 10);
    assert!(after[0] > before[0], "{before:?} -> {after:?}");
    assert_eq!(pipes.lane_writes(), lane);
}

#[tokio::test(flavor = "current_thread")]
async fn a_lost_connection_fails_the_calls_in_flight_once_then_reconnects() {
    // the server reads 5 commands and closes without answering
    let (port, _) = stand_in(Some(5)).await;
    let pipes = Arc::new(Pipes::connect(&target(port), 1, 0, 1));
    pipes.wait(Duration::from_secs(2)).await;
    let calls: Vec<_> = (0..5)
        .map(|_| {
            let pipes = pipes.clone();
            tokio::spawn(async move { pipes.eval("sha", "body", &[], &[]).await })
        })
        .collect();
    for c in calls {
        let e = c.await.expect("task").expect_err("lost");
        assert_eq!(*e.kind(), ErrorKind::IO, "{e}");
    }
    // connected again in the background: the next call is answered
    // (nothing was sent twice: the server counts 5, then 6)
    pipes.wait(Duration::from_secs(2)).await;
    let n = pipes.eval("sha", "body", &[], &[]).await.expect("answered");
    assert_eq!(n, vec![6]);
}

#[tokio::test(flavor = "current_thread")]
async fn calls_fail_at_once_while_the_server_is_down() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    let pipes = Pipes::connect(&target(port), 1, 0, 1);
    let e = pipes.eval("sha", "body", &[], &[]).await.expect_err("down");
    assert_eq!(*e.kind(), ErrorKind::IO);
    // answered without being queued (not waiting for a connection)
    assert!(e.details().starts_with("not connected"), "{e}");
    assert_eq!(pipes.writes(), 0);
}
