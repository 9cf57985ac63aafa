"""Cold and warm TTFT of one running vLLM replica (or emulator), one request at a time.

    python3 scripts/measure-vllm-ttft.py http://127.0.0.1:PORT [SEED]

Prompts use the project's words (w000..wfff: one token each with the tiny model). For each
length: five fresh prompts (cold) each sent again at once (warm: all but the last partial block
cached). Then the decode time per token after a warm prefix. Prints medians in ms.
"""
import json, time, urllib.request, random, statistics as st, sys
url = sys.argv[1]
def req(prompt, n=1):
    body = json.dumps({"model":"cacheroute-model","prompt":prompt,"max_tokens":n,"ignore_eos":True,"stream":True}).encode()
    r = urllib.request.Request(url+"/v1/completions", body, {"content-type":"application/json"})
    t0=time.perf_counter(); first=None
    with urllib.request.urlopen(r) as f:
        for line in f:
            if line.startswith(b"data: {") and first is None: first=time.perf_counter()-t0
    return first*1000, (time.perf_counter()-t0)*1000
rnd=random.Random(int(sys.argv[2]) if len(sys.argv)>2 else 1)
def words(n): return " ".join("w%03x"%rnd.randrange(4096) for _ in range(n))
for n in [128, 640, 1000, 2000]:
    cold=[];warm=[]
    for i in range(5):
        p=words(n); cold.append(req(p)[0]); warm.append(req(p[:])[0])
    print(f"{n} tokens: cold TTFT median {st.median(cold):.1f} ms, warm {st.median(warm):.1f} ms")
p=words(640); req(p)
e=[req(p+" "+words(40), 33) for _ in range(5)]
print(f"decode: 32 tokens after warm TTFT: {st.median([(b-a)/32 for a,b in e]):.2f} ms/token")
