"""A minimal multi-turn chat with streaming replies (public API only).

    python examples/chat.py --model mlx-community/Qwen2.5-0.5B-Instruct-4bit
    FERRUM_METAL_PAGED_KV=1 python examples/chat.py --model ../shared/models/stories260K

Type /exit (or Ctrl-C at the prompt) to quit, /reset to start over; Ctrl-C stops the current reply.
(``mlx-ferrum chat`` also trims the history to fit the context.)
"""

import argparse

import mlx_ferrum as mf

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="mlx-community/Qwen2.5-0.5B-Instruct-4bit")
parser.add_argument("--max-tokens", type=int, default=256)
args = parser.parse_args()

model, tokenizer = mf.load(args.model)
messages = []
while True:
    try:
        user = input(">> ")
    except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave quietly
        print()
        break
    if user.strip() == "/exit":
        break
    if user.strip() == "/reset":
        messages = []
        continue
    messages.append({"role": "user", "content": user})
    # checkpoints without a chat template (base models) just continue the text
    prompt = messages if tokenizer.chat_template else user
    reply = ""
    try:
        for chunk in mf.stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens, temperature=0.7):
            reply += chunk.text
            print(chunk.text, end="", flush=True)
    except KeyboardInterrupt:
        print(" [stopped]", end="")
    except mf.errors.FerrumError as e:  # e.g. the conversation outgrew the context
        print(f"error: {e}")
        messages = messages[:-1]
        continue
    print()
    messages.append({"role": "assistant", "content": reply})
