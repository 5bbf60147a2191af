"""`dflash-robot bench`: offline prompt sets (`datasets`) and side-by-side runs (`runner`)."""
