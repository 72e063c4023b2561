use super::*;

/// Answers a call with its bytes reversed; refuses an empty one.
struct Reverse;

impl StageHandler for Reverse {
    fn handle(&mut self, call: &[u8], reply: &mut Vec<u8>) -> Result<(), String> {
        if call.is_empty() {
            return Err("an empty step".into());
        }
        reply.extend(call.iter().rev());
        Ok(())
    }
}

fn key(k: &str) -> ClusterKey {
    ClusterKey::of(k.as_bytes())
}

fn server(k: &ClusterKey) -> StageServer {
    StageServer::start(TcpListener::bind("127.0.0.1:0").unwrap(), k.clone(), Reverse).unwrap()
}

const T: Duration = Duration::from_secs(5);

#[test]
fn a_head_with_the_key_calls_and_gets_answers_or_refusals() {
    for k in [key("the-cluster-token-1"), ClusterKey::insecure()] {
        let s = server(&k);
        let mut c = StageConn::connect(s.local_addr(), &k, T).unwrap();
        let big: Vec<u8> = (0..3_000_000u32).map(|i| i as u8).collect();
        for body in [&b"abc"[..], &big] {
            let want: Vec<u8> = body.iter().rev().copied().collect();
            assert_eq!(c.call(body).unwrap(), &want[..]);
        }
        let err = c.call(b"").unwrap_err().to_string();
        assert!(err.contains("refused the call: an empty step"), "{err}");
    }
}

#[test]
fn a_head_without_the_key_is_refused_at_the_handshake() {
    let s = server(&key("the-cluster-token-1"));
    for wrong in [key("another-cluster-token"), ClusterKey::insecure()] {
        let err = StageConn::connect(s.local_addr(), &wrong, T).err().unwrap().to_string();
        assert!(err.contains("cluster token") || err.contains("did not answer"), "{err}");
    }
}

#[test]
fn a_newer_head_takes_over_and_the_older_ones_next_call_fails() {
    let k = key("the-cluster-token-1");
    let s = server(&k);
    let mut old = StageConn::connect(s.local_addr(), &k, T).unwrap();
    assert_eq!(old.call(b"12").unwrap(), b"21");
    let mut new = StageConn::connect(s.local_addr(), &k, T).unwrap();
    assert_eq!(new.call(b"34").unwrap(), b"43");
    assert!(old.call(b"56").is_err());
    assert_eq!(new.call(b"78").unwrap(), b"87");
}
