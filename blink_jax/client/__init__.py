"""The JAX-free layer shared by the frontend and the engine: the Python mirror of the mailbox
protocol (`protocol`), the mailbox client (`mailbox`), the mailbox in POSIX shared memory
(`shm`), the tokenizer and the output stream's incremental detokenizing and stop strings
(`streaming`). Nothing here imports JAX: it is the part that runs on the NIC."""
