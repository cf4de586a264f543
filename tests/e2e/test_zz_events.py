import threading, time, json, urllib.request, glob
import grpc
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from cases import CASES

def test_events(stack):
    got = []
    print("ipc", glob.glob("/tmp/pdserve-kv-events-*"))
    def follow(addr):
        ch = grpc.insecure_channel(addr)
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        try:
            for b in stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True), timeout=15):
                for e in b.events:
                    if e.WhichOneof("data") == "stored":
                        st = e.stored
                        got.append((addr, "stored", st.HasField("parent_block_hash"), [(bl.block_hash % 1000, len(bl.token_ids)) for bl in st.blocks], str(st)[:300]))
        except grpc.RpcError as e:
            got.append((addr, "end", e.code().name))
    ts = [threading.Thread(target=follow, args=(a,), daemon=True) for a in (stack.prefill, stack.decode)]
    for t in ts: t.start()
    time.sleep(2)
    c = CASES[1]
    req = urllib.request.Request(f"{stack.url}/v1/completions", data=json.dumps(c.body(stack.model, False)).encode(), headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=60).read()
    time.sleep(5)
    for g in got: print("GOT", g)
    print("\n".join(l for l in stack.proc.lines if "vent" in l or "zmq" in l.lower() or "relay" in l.lower())[-3000:])
