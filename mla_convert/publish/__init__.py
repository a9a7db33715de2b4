"""`mla-convert upload DIR REPO_ID`: a finished conversion published on the Hugging Face Hub.

- contents: what goes up (exactly the manifest's files and the manifest), in which order, in which
  commits; a directory holding anything else, or lacking what it lists, is refused.
- remote: the Hub's side through huggingface_hub (the repo, the branch, what it already holds, one
  file's upload, one commit), its errors as one line each.
- upload: the whole of it: the checks before any byte goes up, the comparison with what the branch
  holds (the resume), the commits, the result (results.UploadResult).
"""
