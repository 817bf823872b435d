"""Waits until a local server answers /health: usage wait_healthy.py PORT TIMEOUT_S SERVER_PID.
Exits 0 once healthy; non-zero, saying why, when the server process exits first or the time runs out.
(The vLLM and SGLang serve scripts beside it share it.)"""
import os, sys, time, urllib.request
port, timeout, pid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
start = time.time()
while time.time() - start < timeout:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited before it was healthy")
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        print(f"healthy after {time.time() - start:.0f} s")
        sys.exit(0)
    except OSError:
        time.sleep(2)
sys.exit(f"not healthy after {timeout:.0f} s")
