//! A `pdserve serve` child process for one topology: started on a free loopback port,
//! waited for until `GET /health` answers 200, stopped with SIGTERM (then SIGKILL if
//! it outlives its grace). Killed on drop, so an aborted comparison leaves nothing
//! running.

use crate::client::get;
use crate::error::BenchError;
use crate::target::Target;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running server.
pub struct ServerProcess {
    name: String,
    child: Child,
    pub port: u16,
    pub log: PathBuf,
}

/// A port nobody listens on right now (the OS picks it; the small race with other
/// processes is acceptable on a benchmark machine).
pub fn free_port() -> Result<u16, BenchError> {
    let l =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| BenchError::Runtime(format!("no free port: {e}")))?;
    l.local_addr().map(|a| a.port()).map_err(|e| BenchError::Runtime(format!("no free port: {e}")))
}

impl ServerProcess {
    /// Starts `exe serve ARGS --port PORT`, output appended to `log`.
    pub fn spawn(name: &str, exe: &Path, serve_args: &[String], log: PathBuf) -> Result<Self, BenchError> {
        let port = free_port()?;
        let out = File::create(&log).map_err(|e| BenchError::io(&log, e))?;
        let err = out.try_clone().map_err(|e| BenchError::io(&log, e))?;
        let child = Command::new(exe)
            .arg("serve")
            .args(serve_args)
            .args(["--port", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| BenchError::Server {
                topology: name.into(),
                reason: format!("cannot start {}: {e}", exe.display()),
            })?;
        Ok(Self { name: name.into(), child, port, log })
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// CPU seconds (user + system) the server has used so far, from `/proc`.
    pub fn cpu_seconds(&self) -> Option<f64> {
        cpu_seconds(&self.child.id().to_string())
    }

    /// Polls `/health` until it answers 200; fails if the process exits first or
    /// `timeout` passes.
    pub async fn wait_healthy(&mut self, timeout: Duration) -> Result<(), BenchError> {
        let target = Target::parse(&self.url(), false)?;
        let path = target.root_path("/health");
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(self.failure(&format!("exited before becoming healthy ({status})")));
            }
            if let Ok((200, _)) = get(&target, &path, Duration::from_secs(2)).await {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(self.failure(&format!("not healthy after {} s", timeout.as_secs())));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// SIGTERM, then up to `grace` for a clean exit, then SIGKILL.
    pub async fn stop(mut self, grace: Duration) -> Result<(), BenchError> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).stdout(Stdio::null()).stderr(Stdio::null()).status();
        let start = Instant::now();
        while start.elapsed() < grace {
            if let Ok(Some(_)) = self.child.try_wait() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        Err(self.failure(&format!("did not exit within {} s of SIGTERM; killed", grace.as_secs())))
    }

    /// An error naming the topology, with the end of its log.
    fn failure(&self, what: &str) -> BenchError {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(3).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        let reason = format!("{what}; log {}: {}", self.log.display(), tail.join(" / "));
        BenchError::Server { topology: self.name.clone(), reason }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// CPU seconds (user + system) process `pid` (or `self`) has used so far, from
/// `/proc`.
pub fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name's closing parenthesis: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    // Linux reports them in USER_HZ, 100 per second on every architecture it runs on.
    Some((ticks(11)? + ticks(12)?) / 100.0)
}
