//! What moving control calls onto NATS request/reply would cost: the round trip of
//! one control-sized message over a direct TCP connection (a length prefix and the
//! bytes, as the control protocol sends them) and as a NATS request through a
//! server, both on this host, interleaved.
//!
//! Usage: `cargo run --release -p pdserve-fleet --example control_rtt -- NATS_URL [BYTES] [ROUNDS]`
//! (`scripts/bench_fleet.py` runs it). Prints one JSON object of p50/p99 in µs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use futures_util::StreamExt;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let url = args.get(1).expect("usage: control_rtt NATS_URL [BYTES] [ROUNDS]").clone();
    let bytes: usize = args.get(2).map_or(2048, |s| s.parse().unwrap());
    let rounds: usize = args.get(3).map_or(2000, |s| s.parse().unwrap());
    let payload = vec![b'x'; bytes];

    // The direct path: an echo server answering each length-prefixed message.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = Vec::new();
        while let Ok(n) = s.read_u32().await {
            buf.resize(n as usize, 0);
            s.read_exact(&mut buf).await.unwrap();
            s.write_u32(n).await.unwrap();
            s.write_all(&buf).await.unwrap();
        }
    });
    let mut direct = TcpStream::connect(addr).await.unwrap();
    direct.set_nodelay(true).unwrap();

    // The NATS path: a responder on the subject a worker would listen on.
    let client = async_nats::connect(url.as_str()).await.unwrap();
    let mut sub = client.subscribe("infer.control.rtt").await.unwrap();
    let responder = client.clone();
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            if let Some(reply) = msg.reply {
                responder.publish(reply, msg.payload).await.unwrap();
            }
        }
    });
    client.flush().await.unwrap();

    let (mut tcp, mut nats) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    let mut buf = vec![0u8; bytes];
    for i in 0..rounds + 100 {
        let t = Instant::now();
        direct.write_u32(bytes as u32).await.unwrap();
        direct.write_all(&payload).await.unwrap();
        let n = direct.read_u32().await.unwrap() as usize;
        direct.read_exact(&mut buf[..n]).await.unwrap();
        let d = t.elapsed();
        let t = Instant::now();
        let answer = client.request("infer.control.rtt", payload.clone().into()).await.unwrap();
        let r = t.elapsed();
        assert_eq!(answer.payload.len(), bytes);
        // The first 100 rounds warm both paths up.
        if i >= 100 {
            tcp.push(d);
            nats.push(r);
        }
    }
    let summary = |mut xs: Vec<Duration>| {
        xs.sort();
        let at = |q: f64| xs[((xs.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e6;
        serde_json::json!({"p50_us": at(0.5), "p99_us": at(0.99)})
    };
    let out = serde_json::json!({"bytes": bytes, "rounds": rounds, "direct_tcp": summary(tcp), "nats_request_reply": summary(nats)});
    println!("{out}");
}
