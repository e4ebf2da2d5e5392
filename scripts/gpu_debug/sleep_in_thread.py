"""Debug aid: does a level-1 sleep/wake work when called from a thread other than the one that
built the engine (as the mp and Ray executors call it)? Prints the traceback if not."""
import threading
import traceback

from service import LLM

OVR = dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, num_hidden_layers=4)

if __name__ == "__main__":
    llm = LLM("tiny", dtype="bfloat16", device="cuda", hf_overrides=OVR, enable_sleep_mode=True,
              sleep_preserve_parameter_names=["*"], distributed_executor_backend="uni")

    def body():
        try:
            llm.sleep(level=1)
            llm.wake_up()
            print("sleep in thread: ok")
        except Exception:
            traceback.print_exc()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    llm.shutdown()
