//! A worker process's ports against peers that announce huge messages: a length
//! prefix costs the worker no memory until the bytes arrive, a stranger cannot make
//! it hold more than a handshake's worth, and whoever holds the token is bounded by
//! the largest legitimate message. The worker keeps serving throughout.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{complete, start, token_file};
use pdserve_kv_transfer::ClusterKey;
use pdserve_remote::control::{self, FromWorker, ToWorker};
use serde_json::json;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Connections per kind of flood (the original report used ten).
const FLOOD: usize = 10;

/// Resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// Reads one control message (u32 length, JSON).
fn read_message(s: &mut TcpStream) -> FromWorker {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    serde_json::from_slice(&body).unwrap()
}

fn write_message(s: &mut TcpStream, msg: &ToWorker) {
    let body = serde_json::to_vec(msg).unwrap();
    s.write_all(&(body.len() as u32).to_be_bytes()).unwrap();
    s.write_all(&body).unwrap();
}

/// A control connection that has read the worker's challenge.
fn challenged(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    assert!(matches!(read_message(&mut s), FromWorker::Challenge { .. }));
    s
}

/// A control connection that proved the cluster token, as a router's does.
fn authenticated(addr: SocketAddr, key: &ClusterKey) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let FromWorker::Challenge { nonce } = read_message(&mut s) else { panic!("no challenge") };
    let proof = key.prove(control::ROUTER_LABEL, &nonce).to_vec();
    write_message(&mut s, &ToWorker::Hello { protocol: control::PROTOCOL_VERSION, proof, nonce: vec![7; 16] });
    assert!(matches!(read_message(&mut s), FromWorker::Hello(_)));
    s
}

/// Announces a message of `announced` bytes and sends `sent` of them.
fn announce(s: &mut TcpStream, announced: u32, sent: usize) {
    s.write_all(&announced.to_be_bytes()).unwrap();
    let _ = s.write_all(&vec![b' '; sent]);
}

/// Whether the worker closed the connection rather than waiting for more bytes (a
/// stranger's handshake may take 10 s before it is given up: this waits less).
fn closed_by_worker(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// The worker's KV port, from its start-up line.
fn kv_port(w: &common::Proc) -> u16 {
    let log = w.log.lock().unwrap();
    let line = log.iter().find(|l| l.contains("KV on tcp port")).unwrap();
    line.rsplit(' ').next().unwrap().trim().parse().unwrap()
}

/// A KV record header (len u32 | tag u8 | handoff u64, little-endian) announcing
/// `body` bytes.
fn kv_header(tag: u8, body: u32) -> [u8; 13] {
    let mut h = [0u8; 13];
    h[..4].copy_from_slice(&(body + 9).to_le_bytes());
    h[4] = tag;
    h
}

#[test]
fn length_prefixes_that_announce_megabytes_cost_a_worker_no_memory() {
    let w = start(&["worker", "--role", "mixed", "--listen", "127.0.0.1:0", "--threads", "1", "--kv-blocks", "256"]);
    let pid = w.child.id();
    let key = ClusterKey::from_file(std::path::Path::new(token_file())).unwrap();
    let kv = SocketAddr::from(([127, 0, 0, 1], kv_port(&w)));
    let before = rss(pid);

    // Strangers on the control port: 64 MiB is refused at once; so is a message just
    // under the authenticated limit, since nobody proved the token yet.
    let mut strangers = Vec::new();
    for announced in [64 << 20, control::MAX_MESSAGE as u32 - 1] {
        for _ in 0..FLOOD {
            let mut s = challenged(w.addr);
            announce(&mut s, announced, 64 << 10);
            strangers.push(s);
        }
    }
    // Strangers on the KV port: a 13-byte header announcing 64 MiB, as a first record.
    for _ in 0..FLOOD {
        let mut s = TcpStream::connect(kv).unwrap();
        s.write_all(&kv_header(8, 64 << 20)).unwrap();
        let _ = s.write_all(&[0u8; 4096]);
        strangers.push(s);
    }
    for s in &mut strangers {
        assert!(closed_by_worker(s), "a stranger's huge message was waited for");
    }

    // Token holders: past the largest message the connection is dropped; below it,
    // memory grows only with the bytes that came (256 KiB each here, not 8 MiB).
    let mut over = authenticated(w.addr, &key);
    announce(&mut over, 64 << 20, 4096);
    assert!(closed_by_worker(&mut over), "a 64 MiB control message was waited for");
    let mut slow = Vec::new();
    for _ in 0..FLOOD {
        let mut s = authenticated(w.addr, &key);
        announce(&mut s, control::MAX_MESSAGE as u32 - 1, 256 << 10);
        slow.push(s);
    }
    std::thread::sleep(Duration::from_millis(500));
    let grown = rss(pid).saturating_sub(before);
    // Pre-allocating what was announced would be 10 × 8 MiB here; the bytes sent are
    // 10 × 256 KiB. Allow buffers, threads and allocator slack in between.
    assert!(grown < 32 << 20, "the worker grew by {} MiB", grown >> 20);

    // It still serves.
    let fe = start(&["frontend", "--workers", &w.addr.to_string(), "--mode", "aggregated", "--port", "0"]);
    assert!(!complete(fe.addr, &json!([504, 3575, 282]), 4).is_empty());
    drop(slow);

    // A token holder that then says nothing (no ping: a frozen host sends no FIN)
    // is dropped after 10 s of silence, not kept until TCP gives up.
    let mut quiet = authenticated(w.addr, &key);
    let t = std::time::Instant::now();
    quiet.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = [0u8; 64];
    let closed = loop {
        match quiet.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => continue,
            Err(e) => break e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    };
    assert!(closed, "a silent router was kept {:?}", t.elapsed());
}

/// Idle strangers from one address, as many as a port used to serve (64, each
/// reopened as soon as the worker closes it, as the probe's script did), take none
/// of the slots routers need: a frontend started during the attack connects and
/// serves, and the refusals are logged a few times, not once each.
#[test]
fn idle_strangers_do_not_lock_routers_out_of_a_worker() {
    let w = start(&["worker", "--role", "mixed", "--listen", "127.0.0.1:0", "--threads", "1", "--kv-blocks", "256"]);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let attack = std::thread::spawn({
        let (to, stop) = (w.addr, stop.clone());
        move || hold_idle_connections(to, 64, &stop)
    });
    let fe = start(&["frontend", "--workers", &w.addr.to_string(), "--mode", "aggregated", "--port", "0"]);
    let served = complete(fe.addr, &json!([504, 3575, 282]), 4);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let opened = attack.join().unwrap();
    assert!(!served.is_empty(), "the frontend was locked out");
    assert!(opened > 64, "the attack never reconnected ({opened} connections)");
    let refusals = w.log.lock().unwrap().iter().filter(|l| l.contains("a router connection refused")).count();
    assert!((1..=6).contains(&refusals), "{refusals} refusal lines for {opened} connections");
}

/// Keeps `n` connections from 127.0.0.2 open to `to`, reopening each the moment the
/// worker closes it, until `stop` (or a minute); answers how many it opened.
fn hold_idle_connections(to: SocketAddr, n: usize, stop: &std::sync::atomic::AtomicBool) -> usize {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let connect = || async {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            s.connect(to).await.ok()
        };
        let (mut held, mut opened) = (Vec::new(), 0);
        let end = tokio::time::Instant::now() + Duration::from_secs(60);
        while !stop.load(std::sync::atomic::Ordering::Relaxed) && tokio::time::Instant::now() < end {
            held.retain(still_open);
            while held.len() < n {
                let Some(c) = connect().await else { break };
                held.push(c);
                opened += 1;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        opened
    })
}

/// Whether the worker has not closed `c`: a closed connection reads 0 bytes (or
/// fails), an open one has nothing more to read.
fn still_open(c: &tokio::net::TcpStream) -> bool {
    let mut buf = [0u8; 512];
    loop {
        match c.try_read(&mut buf) {
            Ok(0) => return false,
            Ok(_) => continue,
            Err(e) => return e.kind() == std::io::ErrorKind::WouldBlock,
        }
    }
}
